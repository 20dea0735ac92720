"""The dynamic batcher alone: batch forming, priorities, shapes, queue policies, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from cloud_service.batcher import (
    BatcherClosedError,
    BatcherConfig,
    BatchInfo,
    DynamicBatcher,
    QueueFullError,
    QueueTimeoutError,
)


class Recorder:
    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay
        self.gate = gate

    def __call__(self, items: Sequence[str]) -> list[str]:
        if self.gate is not None:
            self.gate.wait(5)
        time.sleep(self.delay)
        self.batches.append(list(items))
        return [f"done:{i}" for i in items]


def test_batches_fill_up_to_max_and_results_match() -> None:
    run = Recorder()
    with DynamicBatcher(run, BatcherConfig(max_batch_size=8, max_queue_delay_s=0.05)) as b:
        futures = [b.submit(str(i)) for i in range(20)]
        results = [f.result(5) for f in futures]
    assert results == [f"done:{i}" for i in range(20)]
    assert max(len(batch) for batch in run.batches) == 8
    assert sum(len(batch) for batch in run.batches) == 20


def test_delay_sends_a_partial_batch_once_the_oldest_waited_long_enough() -> None:
    run = Recorder()
    with DynamicBatcher(run, BatcherConfig(max_batch_size=64, max_queue_delay_s=0.05)) as b:
        start = time.monotonic()
        futures = [b.submit(str(i)) for i in range(3)]
        for f in futures:
            f.result(5)
        waited = time.monotonic() - start
    assert run.batches == [["0", "1", "2"]]
    assert 0.04 <= waited < 1.0


def test_priority_then_lowest_order_key_first() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    config = BatcherConfig(max_batch_size=2, max_queue_delay_s=0.0, priority_levels=10)
    with DynamicBatcher(run, config) as b:
        first = b.submit("blocker")  # occupies the only worker until the gate opens
        time.sleep(0.05)
        futures = [
            b.submit("low-p", priority=1, order=0.1),
            b.submit("high-p-sure", priority=9, order=0.9),
            b.submit("high-p-unsure", priority=9, order=0.2),
            b.submit("mid-p", priority=5, order=0.5),
        ]
        gate.set()
        first.result(5)
        for f in futures:
            f.result(5)
    assert run.batches[1:] == [["high-p-unsure", "high-p-sure"], ["mid-p", "low-p"]]


def test_batches_never_mix_shapes() -> None:
    run = Recorder()
    with DynamicBatcher(run, BatcherConfig(max_batch_size=16, max_queue_delay_s=0.02)) as b:
        futures = [b.submit(f"{i % 2}-{i}", shape=(i % 2,)) for i in range(10)]
        for f in futures:
            f.result(5)
    for batch in run.batches:
        assert len({item.split("-")[0] for item in batch}) == 1


def test_preferred_batch_sizes_are_used_when_enough_wait() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    config = BatcherConfig(max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_s=1)
    with DynamicBatcher(run, config) as b:
        blocker = b.submit("x", shape="other")
        time.sleep(0.05)
        futures = [b.submit(str(i)) for i in range(12)]
        gate.set()
        blocker.result(5)
        for f in futures:
            f.result(5)
    sizes = [len(batch) for batch in run.batches[1:]]
    assert sizes[0] == 8  # the largest preferred size that fits, sent without waiting


def test_reject_policy_refuses_when_full() -> None:
    gate = threading.Event()
    config = BatcherConfig(max_batch_size=1, max_queue_size=2, queue_policy="reject")
    with DynamicBatcher(Recorder(gate=gate), config) as b:
        b.submit("running")
        time.sleep(0.05)
        b.submit("a")
        b.submit("b")
        with pytest.raises(QueueFullError, match="full"):
            b.submit("c")
        gate.set()


def test_delay_policy_fails_after_the_submit_timeout() -> None:
    gate = threading.Event()
    config = BatcherConfig(
        max_batch_size=1, max_queue_size=1, queue_policy="delay", submit_timeout_s=0.1
    )
    with DynamicBatcher(Recorder(gate=gate), config) as b:
        b.submit("running")
        time.sleep(0.05)
        b.submit("a")
        with pytest.raises(QueueFullError, match="stayed full"):
            b.submit("b")
        gate.set()


def test_delay_policy_waits_for_room() -> None:
    gate = threading.Event()
    config = BatcherConfig(
        max_batch_size=1, max_queue_size=1, queue_policy="delay", submit_timeout_s=5
    )
    with DynamicBatcher(Recorder(gate=gate), config) as b:
        b.submit("running")
        time.sleep(0.05)
        b.submit("a")
        threading.Timer(0.1, gate.set).start()
        start = time.monotonic()
        assert b.submit("b").result(5) == "done:b"  # blocked until "a" left the queue
        assert time.monotonic() - start >= 0.05


def test_requests_waiting_too_long_time_out_instead_of_running_late() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    config = BatcherConfig(max_batch_size=1, timeout_s=0.05)
    with DynamicBatcher(run, config) as b:
        b.submit("running")
        time.sleep(0.02)
        waiting = b.submit("late")
        threading.Timer(0.2, gate.set).start()
        with pytest.raises(QueueTimeoutError):
            waiting.result(2)
    assert ["late"] not in run.batches


def test_a_failed_batch_fails_its_requests_and_the_batcher_goes_on() -> None:
    calls = []

    def run(items: Sequence[str]) -> list[str]:
        calls.append(list(items))
        if "bad" in items:
            raise RuntimeError("model exploded")
        return list(items)

    infos: list[BatchInfo] = []
    config = BatcherConfig(max_batch_size=4, max_queue_delay_s=0.0)
    with DynamicBatcher(run, config, on_batch=infos.append) as b:
        bad = b.submit("bad")
        with pytest.raises(RuntimeError, match="exploded"):
            bad.result(5)
        assert b.submit("good").result(5) == "good"
    assert infos[0].failed and not infos[-1].failed
    assert infos[-1].size == 1 and infos[-1].compute_s >= 0


def test_closing_without_drain_fails_waiting_requests() -> None:
    gate = threading.Event()
    b = DynamicBatcher(Recorder(gate=gate), BatcherConfig(max_batch_size=1)).start()
    b.submit("running")
    time.sleep(0.05)
    waiting = b.submit("never")
    threading.Timer(0.1, gate.set).start()
    b.close(drain=False)
    with pytest.raises(Exception, match="closed"):
        waiting.result(1)


def test_submit_many_queues_like_submit_in_one_hand_off() -> None:
    seen: list[list[str]] = []

    def run(items: Sequence[str]) -> list[str]:
        seen.append(list(items))
        return [item.upper() for item in items]

    config = BatcherConfig(max_batch_size=4, max_queue_delay_s=0.05, priority_levels=2)
    with DynamicBatcher(run, config) as batcher:
        futures = batcher.submit_many(
            [("a", "s", 0, 0.0), ("b", "s", 1, 0.0), ("c", "s", 0, -1.0), ("d", "s", 1, 0.0)]
        )
        assert [f.result(5) for f in futures] == ["A", "B", "C", "D"]
    # One batch, most urgent level first, then the smaller order key.
    assert seen == [["b", "d", "c", "a"]]


def test_submit_many_refuses_when_closed() -> None:
    batcher: DynamicBatcher[str, str] = DynamicBatcher(lambda items: list(items))
    batcher.start()
    batcher.close()
    with pytest.raises(BatcherClosedError):
        batcher.submit_many([("a", None, 0, 0.0)])
