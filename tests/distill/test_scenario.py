from __future__ import annotations

import numpy as np
import pytest

from distill.scenario import (
    DIGIT_CLASSES,
    SPLITS,
    ScenarioConfig,
    load_digit_sources,
    render_digit,
    render_split,
    split_indices,
)

# Bypass the per-process cache to see what a fresh render produces.
_render = render_split.__wrapped__
_SMALL = ScenarioConfig(frame_size=32, eval_renders=1)


def test_sources_are_the_real_digits() -> None:
    src = load_digit_sources()
    assert src.images.shape == (1797, 8, 8)
    assert set(np.unique(src.labels)) == set(range(10))
    assert src.images.min() >= 0.0 and src.images.max() <= 1.0
    assert src.identity.startswith("sklearn-digits:")


def test_splits_partition_the_source_scans() -> None:
    src = load_digit_sources()
    parts = split_indices(src.labels, ScenarioConfig().split_fractions, seed=0)
    assert set(parts) == set(SPLITS)
    seen = np.concatenate(list(parts.values()))
    assert len(seen) == len(set(seen.tolist())) == len(src.labels)
    sizes = {s: len(v) for s, v in parts.items()}
    assert sizes["train"] > sizes["test"] > sizes["validation"] > 0
    for idx in parts.values():  # stratified: every class in every split
        assert set(np.unique(src.labels[idx])) == set(range(10))


def test_rendered_splits_never_share_a_scan(quick_scenario: ScenarioConfig) -> None:
    sources = {s: set(render_split(s, quick_scenario).sources.tolist()) for s in SPLITS}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not sources[a] & sources[b], (a, b)


def test_rendering_is_deterministic_per_seed() -> None:
    a = _render("validation", _SMALL)
    b = _render("validation", _SMALL)
    c = _render("validation", ScenarioConfig(frame_size=32, eval_renders=1, seed=1))
    np.testing.assert_array_equal(a.frames, b.frames)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.frames, c.frames)


def test_frames_look_like_camera_frames() -> None:
    fs = _render("validation", _SMALL)
    assert fs.frames.dtype == np.uint8 and fs.frames.shape[1:] == (32, 32, 3)
    assert fs.class_names == DIGIT_CLASSES
    assert fs.masks is not None and fs.masks.max() <= 1.0
    # Textured, not flat: background pixels vary within a frame, ink is darker.
    frame, mask = fs.frames[0].astype(float), fs.masks[0]
    assert frame[mask < 0.05].std() > 2.0
    assert frame[mask > 0.8].mean() < frame[mask < 0.05].mean() - 40


def test_training_split_renders_each_scan_several_times(quick_scenario: ScenarioConfig) -> None:
    train = render_split("train", quick_scenario)
    counts = np.bincount(train.sources)
    assert set(counts[counts > 0].tolist()) == {quick_scenario.train_renders}
    # Two renders of one scan differ in placement.
    first = np.flatnonzero(train.sources == train.sources[0])
    assert not np.array_equal(train.frames[first[0]], train.frames[first[1]])


def test_render_digit_respects_frame_size() -> None:
    digit = load_digit_sources().images[0]
    rng = np.random.default_rng(0)
    for size in (16, 48, 96):
        frame, mask = render_digit(digit, rng, frame_size=size)
        assert frame.shape == (size, size, 3) and mask.shape == (size, size)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"frame_size": 8},
        {"split_fractions": (0.5, 0.5, 0.5, 0.5)},
        {"scale_range": (0.9, 0.2)},
        {"train_renders": 0},
    ],
)
def test_bad_scenario_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ScenarioConfig(**kwargs)  # type: ignore[arg-type]
