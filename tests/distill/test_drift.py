from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from distill.drift import (
    DRIFT_NAMES,
    Drift,
    DriftSchedule,
    DriftSpecError,
    FrameStream,
    apply_drift,
    format_drift_spec,
    parse_drift_spec,
    parse_drift_specs,
)
from distill.frames import FrameSet


@pytest.fixture(scope="module")
def sample(small_test_set: FrameSet) -> FrameSet:
    return small_test_set.subset(slice(0, 24))


@pytest.mark.parametrize("name", DRIFT_NAMES)
def test_severity_zero_is_identity(sample: FrameSet, name: str) -> None:
    np.testing.assert_array_equal(apply_drift(sample, (Drift(name, 0.0),), seed=3), sample.frames)


@pytest.mark.parametrize("name", DRIFT_NAMES)
def test_pixels_change_monotonically_with_severity(sample: FrameSet, name: str) -> None:
    clean = sample.frames.astype(np.float32)
    diffs = [
        float(np.abs(apply_drift(sample, (Drift(name, s),), seed=3) - clean).mean())
        for s in (0.25, 0.5, 0.75, 1.0)
    ]
    assert diffs[0] > 0.5, diffs
    assert all(b > a for a, b in itertools.pairwise(diffs)), diffs


@pytest.mark.parametrize("name", DRIFT_NAMES)
def test_drift_keeps_shape_dtype_and_is_deterministic(sample: FrameSet, name: str) -> None:
    a = apply_drift(sample, (Drift(name, 0.7),), seed=5)
    b = apply_drift(sample, (Drift(name, 0.7),), seed=5)
    assert a.shape == sample.frames.shape and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)


def test_drift_works_without_masks(sample: FrameSet) -> None:
    bare = apply_drift(sample.frames, (Drift("background", 1.0), Drift("rotation", 1.0)), seed=1)
    assert bare.shape == sample.frames.shape
    assert np.abs(bare.astype(float) - sample.frames).mean() > 5


def test_parse_single_and_composed_specs() -> None:
    assert parse_drift_spec("blur:0.8") == (Drift("blur", 0.8),)
    spec = parse_drift_spec(" noise:1.0 , Rotation:0.5 ")
    # Applied in imaging-chain order whatever the written order.
    assert spec == (Drift("rotation", 0.5), Drift("noise", 1.0))
    assert format_drift_spec(spec) == "rotation:0.5,noise:1"
    assert parse_drift_spec("none") == () == parse_drift_spec("")
    assert parse_drift_specs(["blur:0.2", "jpeg:1,lighting:0.1"]) == (
        Drift("lighting", 0.1),
        Drift("blur", 0.2),
        Drift("jpeg", 1.0),
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("fog:0.5", "unknown drift 'fog'; known drifts: background, rotation"),
        ("blur:1.5", "must be in [0, 1]"),
        ("blur:-0.1", "must be in [0, 1]"),
        ("blur:nan", "must be in [0, 1]"),
        ("blur:high", "expected a number in [0, 1]"),
        ("blur", "expected NAME:SEVERITY"),
        ("blur:", "expected NAME:SEVERITY"),
        ("blur:0.1,blur:0.2", "given twice"),
    ],
)
def test_bad_specs_are_refused_clearly(text: str, needle: str) -> None:
    with pytest.raises(DriftSpecError) as info:
        parse_drift_spec(text)
    assert needle in str(info.value)


def test_stream_keeps_labels_and_reports_drift_state(sample: FrameSet) -> None:
    stream = FrameStream(
        sample,
        drift=(Drift("blur", 1.0), Drift("noise", 0.5)),
        schedule=DriftSchedule("gradual", start=10, length=20),
        limit=60,
        seed=2,
    )
    frames = list(stream)
    assert [f.index for f in frames] == list(range(60))
    for f in frames:
        # The frame's label is the label of the pool frame it came from.
        matches = [i for i in range(len(sample)) if sample.labels[i] == f.label]
        assert matches and f.class_name == sample.class_names[f.label]
    assert frames[5].drift == {"blur": 0.0, "noise": 0.0}
    assert frames[20].drift == pytest.approx({"blur": 0.5, "noise": 0.25})
    assert frames[45].drift == {"blur": 1.0, "noise": 0.5}
    np.testing.assert_array_equal(frames[5].frame, sample.frames[_pool_index(stream, 5)])
    # Every pool frame appears once per pass.
    first_pass = sorted(_pool_index(stream, i) for i in range(len(sample)))
    assert first_pass == list(range(len(sample)))


def _pool_index(stream: FrameStream, index: int) -> int:
    order = np.random.default_rng([stream.seed, 104729]).permutation(len(stream.pool))
    return int(order[index])


def test_abrupt_schedule() -> None:
    sched = DriftSchedule("abrupt", start=3)
    assert [sched.factor(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert DriftSchedule("none").factor(100) == 0
    with pytest.raises(DriftSpecError):
        DriftSchedule("gradual", start=0, length=0)


def test_stream_is_paced_by_rate(sample: FrameSet) -> None:
    now = [0.0]
    sleeps: list[float] = []

    def clock() -> float:
        return now[0]

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    frames = list(FrameStream(sample, rate=10.0, limit=5, clock=clock, sleep=sleep))
    assert [round(f.timestamp, 6) for f in frames] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert sum(sleeps) == pytest.approx(0.4)
    assert all(math.isclose(s, 0.1) for s in sleeps)


def test_unpaced_stream_never_sleeps(sample: FrameSet) -> None:
    def sleep(s: float) -> None:
        raise AssertionError("unpaced stream slept")

    assert len(list(FrameStream(sample, limit=30, sleep=sleep))) == 30
