"""Sample ids: UUIDv7 form, monotonic order, time extraction, validation."""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidIdError
from shared.ids import (
    OsRandomBits,
    SampleIdGenerator,
    format_utc,
    new_sample_id,
    parse_utc,
    sample_id_time,
    validate_sample_id,
)


def _is_uuid7(value: str) -> bool:
    parsed = uuid.UUID(value)
    return parsed.version == 7 and parsed.variant == uuid.RFC_4122 and str(parsed) == value


def test_new_sample_id_is_canonical_uuid7() -> None:
    value = new_sample_id()
    assert len(value) == 36
    assert value == value.lower()
    assert _is_uuid7(value)
    assert validate_sample_id(value) == value


def test_ten_thousand_ids_are_valid_unique_and_strictly_increasing() -> None:
    values = [new_sample_id() for _ in range(10_000)]
    assert all(_is_uuid7(v) for v in values)
    # Canonical lowercase hex sorts as the 128-bit number does.
    assert all(a < b for a, b in itertools.pairwise(values))
    assert all(uuid.UUID(a).int < uuid.UUID(b).int for a, b in itertools.pairwise(values))


def test_counter_overflow_in_one_millisecond_bumps_the_timestamp() -> None:
    frozen_ns = 1_717_243_815_123_000_000
    generate = SampleIdGenerator(clock_ns=lambda: frozen_ns)
    values = [generate() for _ in range(10_000)]
    assert all(a < b for a, b in itertools.pairwise(values))
    first, last = sample_id_time(values[0]), sample_id_time(values[-1])
    assert first == datetime(2024, 6, 1, 12, 10, 15, 123000, tzinfo=UTC)
    # At most 4096 and at least 2048 ids per millisecond.
    assert timedelta(milliseconds=2) <= last - first <= timedelta(milliseconds=5)


def test_clock_stepping_back_keeps_ids_increasing() -> None:
    clock = iter([5_000_000_000, 4_000_000_000, 3_000_000_000, 5_000_000_000, 6_000_000_000])
    generate = SampleIdGenerator(clock_ns=lambda: next(clock))
    values = [generate() for _ in range(5)]
    assert values == sorted(values)
    assert len(set(values)) == 5


def test_ids_are_unique_and_ordered_per_thread_under_contention() -> None:
    results: list[list[str]] = [[] for _ in range(4)]

    def work(out: list[str]) -> None:
        out.extend(new_sample_id() for _ in range(2_500))

    threads = [threading.Thread(target=work, args=(out,)) for out in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [v for out in results for v in out]
    assert len(set(everything)) == 10_000
    for out in results:
        assert out == sorted(out)


def test_sample_id_time_is_utc_and_close_to_now() -> None:
    before = datetime.now(UTC)
    stamp = sample_id_time(new_sample_id())
    after = datetime.now(UTC)
    assert stamp.tzinfo is UTC
    assert before - timedelta(milliseconds=2) <= stamp <= after + timedelta(milliseconds=2)


def test_validate_sample_id_normalises_uppercase() -> None:
    value = new_sample_id()
    assert validate_sample_id(value.upper()) == value


@pytest.mark.parametrize(
    "bad",
    [
        str(uuid.uuid4()),
        str(uuid.uuid1()),
        "0190f5c2-7a1b-7c3d-0e4f-0123456789ab",  # NCS variant
        "0190f5c2-7a1b-7c3d-ce4f-0123456789ab",  # Microsoft variant
        "0190f5c27a1b7c3d8e4f0123456789ab",  # no hyphens
        "{0190f5c2-7a1b-7c3d-8e4f-0123456789ab}",
        "urn:uuid:0190f5c2-7a1b-7c3d-8e4f-0123456789ab",
        "0190f5c2-7a1b-7c3d-8e4f-0123456789ab\n",
        "0190f5c2-7a1b-7c3d-8e4f-0123456789aG",
        "",
        None,
        42,
        b"0190f5c2-7a1b-7c3d-8e4f-0123456789ab",
    ],
)
def test_validate_sample_id_refuses_anything_but_uuid7(bad: object) -> None:
    with pytest.raises(InvalidIdError, match="expected a UUIDv7") as info:
        validate_sample_id(bad)
    assert info.value.reason == "invalid_id"


@settings(max_examples=300, deadline=None, database=None)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=40), st.integers(), st.none()))
def test_validate_sample_id_only_raises_invalid_id_error(value: object) -> None:
    try:
        result = validate_sample_id(value)
    except InvalidIdError:
        return
    assert _is_uuid7(result)


def test_utc_timestamps_parse_and_format() -> None:
    assert parse_utc("2024-05-01T14:00:00+02:00") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert (
        format_utc(datetime(2024, 5, 1, 12, 0, 0, 5, tzinfo=UTC)) == "2024-05-01T12:00:00.000005Z"
    )
    for bad in ["2024-05-01T12:00:00", "yesterday", 1714564800, "9999-12-31T23:00:00-05:00"]:
        with pytest.raises(ValueError):
            parse_utc(bad)


def test_os_random_bits_are_in_range_and_spread_over_every_bit() -> None:
    bits = OsRandomBits(chunk=64)  # a small chunk: many refills in this test
    values = [bits(62) for _ in range(4_000)]
    assert all(0 <= v < 2**62 for v in values)
    assert len(set(values)) == len(values)
    # Each of the 62 bits is set in roughly half of the draws.
    for bit in range(62):
        share = sum(v >> bit & 1 for v in values) / len(values)
        assert 0.4 < share < 0.6, bit
    assert all(0 <= bits(11) < 2**11 for _ in range(1_000))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_reuse_the_bits_its_parent_read_ahead() -> None:
    bits = OsRandomBits()
    bits(62)  # the parent has 4 KiB read ahead now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next draw, then leave at once
        os.write(write, bits(62).to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    child = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    os.waitpid(pid, 0)
    assert child != bits(62)


def test_ids_read_the_os_random_source_once_per_hundreds_of_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """os.urandom lets go of the GIL around its system call: one call per id made each
    id a GIL hand-off, which a busy agent paid for in waiting. Bits are read ahead."""
    calls: list[int] = []
    real = os.urandom

    def counted(size: int) -> bytes:
        calls.append(size)
        return real(size)

    monkeypatch.setattr(os, "urandom", counted)
    generate = SampleIdGenerator()
    values = [generate() for _ in range(2_000)]
    assert len(set(values)) == 2_000
    assert len(calls) <= 5  # 4 KiB a call: 8 bytes per id, 2 more per new millisecond
