"""The dynamic batcher alone: batch forming, priorities, shapes, queue policies, timeouts.

Delays and timeouts are checked on a ``FakeClock`` that only the test moves, and a
busy worker is held on a gate the test opens, so no assertion depends on how fast
this machine is.
"""

from __future__ import annotations

import threading
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
from tests.clocks import FakeClock

DELAY_S = 0.0625  # delays on a FakeClock: a power of two, so sums stay exact
SAFETY_NET_S = 30.0  # how long a future or a gate may take before the test gives up


class Recorder:
    """A run_batch that records its batches; with a ``gate``, each batch waits for it.

    ``started`` is set when the first batch reaches it (before the gate).
    """

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, items: Sequence[str]) -> list[str]:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(SAFETY_NET_S)
        self.batches.append(list(items))
        return [f"done:{i}" for i in items]


def test_batches_fill_up_to_max_and_results_match() -> None:
    run = Recorder()
    clock = FakeClock()  # stands still: only full batches go until the test moves it
    config = BatcherConfig(max_batch_size=8, max_queue_delay_s=DELAY_S)
    with DynamicBatcher(run, config, clock=clock) as b:
        futures = [b.submit(str(i)) for i in range(20)]
        results = [f.result(SAFETY_NET_S) for f in futures[:16]]
        assert not any(f.done() for f in futures[16:])  # four wait for their delay
        clock.advance(DELAY_S)
        results += [f.result(SAFETY_NET_S) for f in futures[16:]]
    assert results == [f"done:{i}" for i in range(20)]
    assert [len(batch) for batch in run.batches] == [8, 8, 4]


def test_delay_sends_a_partial_batch_once_the_oldest_waited_long_enough() -> None:
    run = Recorder()
    infos: list[BatchInfo] = []
    clock = FakeClock()
    config = BatcherConfig(max_batch_size=64, max_queue_delay_s=DELAY_S)
    with DynamicBatcher(run, config, on_batch=infos.append, clock=clock) as b:
        futures = [b.submit(str(i)) for i in range(3)]
        clock.advance(DELAY_S / 2)
        reads = clock.reads
        assert clock.wait_for_reads(reads + 1)  # the worker looked: half the delay is left
        assert not any(f.done() for f in futures)
        clock.advance(DELAY_S / 2)
        for f in futures:
            f.result(SAFETY_NET_S)
    assert run.batches == [["0", "1", "2"]]
    assert infos[0].queue_delays_s == (DELAY_S, DELAY_S, DELAY_S)


def test_priority_then_lowest_order_key_first() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    config = BatcherConfig(max_batch_size=2, max_queue_delay_s=0.0, priority_levels=10)
    with DynamicBatcher(run, config) as b:
        first = b.submit("blocker")  # occupies the only worker until the gate opens
        assert run.started.wait(SAFETY_NET_S)
        futures = [
            b.submit("low-p", priority=1, order=0.1),
            b.submit("high-p-sure", priority=9, order=0.9),
            b.submit("high-p-unsure", priority=9, order=0.2),
            b.submit("mid-p", priority=5, order=0.5),
        ]
        gate.set()
        first.result(SAFETY_NET_S)
        for f in futures:
            f.result(SAFETY_NET_S)
    assert run.batches[1:] == [["high-p-unsure", "high-p-sure"], ["mid-p", "low-p"]]


def test_batches_never_mix_shapes() -> None:
    run = Recorder()
    with DynamicBatcher(run, BatcherConfig(max_batch_size=16, max_queue_delay_s=0.02)) as b:
        futures = [b.submit(f"{i % 2}-{i}", shape=(i % 2,)) for i in range(10)]
        for f in futures:
            f.result(SAFETY_NET_S)
    for batch in run.batches:
        assert len({item.split("-")[0] for item in batch}) == 1


def test_preferred_batch_sizes_are_used_when_enough_wait() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    clock = FakeClock()
    config = BatcherConfig(max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_s=1)
    with DynamicBatcher(run, config, clock=clock) as b:
        blocker = b.submit("x", shape="other")
        clock.advance(1)  # the blocker has waited its delay: it goes alone
        futures = [b.submit(str(i)) for i in range(12)]  # the worker wakes for the first
        assert run.started.wait(SAFETY_NET_S)
        gate.set()
        blocker.result(SAFETY_NET_S)
        for f in futures[:8]:
            f.result(SAFETY_NET_S)
        clock.advance(1)  # the four left have waited their delay
        for f in futures[8:]:
            f.result(SAFETY_NET_S)
    sizes = [len(batch) for batch in run.batches]
    # The largest preferred size that fits, sent while the clock stood still (without
    # waiting for the delay), then the rest once their delay had passed.
    assert sizes == [1, 8, 4]


def test_reject_policy_refuses_when_full() -> None:
    gate = threading.Event()
    config = BatcherConfig(max_batch_size=1, max_queue_size=2, queue_policy="reject")
    run = Recorder(gate=gate)
    with DynamicBatcher(run, config) as b:
        b.submit("running")
        assert run.started.wait(SAFETY_NET_S)
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
    run = Recorder(gate=gate)
    with DynamicBatcher(run, config) as b:
        b.submit("running")
        assert run.started.wait(SAFETY_NET_S)
        b.submit("a")
        with pytest.raises(QueueFullError, match="stayed full"):
            b.submit("b")
        gate.set()


def test_delay_policy_waits_for_room() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    clock = FakeClock()
    config = BatcherConfig(
        max_batch_size=1, max_queue_size=1, queue_policy="delay", submit_timeout_s=5
    )
    answers: list[str] = []
    with DynamicBatcher(run, config, clock=clock) as b:
        b.submit("running")
        assert run.started.wait(SAFETY_NET_S)
        b.submit("a")  # the queue is full until the gate lets "running" finish
        submitter = threading.Thread(
            target=lambda: answers.append(b.submit("b").result(SAFETY_NET_S)), name="submitter"
        )
        submitter.start()
        # It reads the clock for its submit timeout once it waits for room.
        assert clock.wait_for(lambda: "submitter" in clock.readers)
        assert submitter.is_alive() and answers == []
        gate.set()
        submitter.join(SAFETY_NET_S)
    assert answers == ["done:b"]  # it waited for "a" to leave the queue, then went
    assert run.batches == [["running"], ["a"], ["b"]]


def test_requests_waiting_too_long_time_out_instead_of_running_late() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    clock = FakeClock()
    config = BatcherConfig(max_batch_size=1, timeout_s=DELAY_S)
    with DynamicBatcher(run, config, clock=clock) as b:
        b.submit("running")
        assert run.started.wait(SAFETY_NET_S)
        waiting = b.submit("late")
        clock.advance(DELAY_S)  # "late" has waited its timeout while "running" ran
        gate.set()
        with pytest.raises(QueueTimeoutError):
            waiting.result(SAFETY_NET_S)
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
            bad.result(SAFETY_NET_S)
        assert b.submit("good").result(SAFETY_NET_S) == "good"
    assert infos[0].failed and not infos[-1].failed
    assert infos[-1].size == 1 and infos[-1].compute_s >= 0


def test_closing_without_drain_fails_waiting_requests() -> None:
    gate = threading.Event()
    run = Recorder(gate=gate)
    b = DynamicBatcher(run, BatcherConfig(max_batch_size=1)).start()
    b.submit("running")
    assert run.started.wait(SAFETY_NET_S)
    waiting = b.submit("never")
    # close() fails what waits at once, then joins the worker, which the gate holds.
    closing = threading.Thread(target=b.close, kwargs={"drain": False})
    closing.start()
    with pytest.raises(Exception, match="closed"):
        waiting.result(SAFETY_NET_S)
    gate.set()
    closing.join(SAFETY_NET_S)
    assert not closing.is_alive()
    assert run.batches == [["running"]]


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
        assert [f.result(SAFETY_NET_S) for f in futures] == ["A", "B", "C", "D"]
    # One batch, most urgent level first, then the smaller order key.
    assert seen == [["b", "d", "c", "a"]]


def test_submit_many_refuses_when_closed() -> None:
    batcher: DynamicBatcher[str, str] = DynamicBatcher(lambda items: list(items))
    batcher.start()
    batcher.close()
    with pytest.raises(BatcherClosedError):
        batcher.submit_many([("a", None, 0, 0.0)])


def test_queue_many_batches_like_submit_many_with_no_future_to_settle() -> None:
    seen: list[list[str]] = []
    done = threading.Event()

    def run(items: Sequence[str]) -> list[str]:
        seen.append(list(items))
        if sum(len(batch) for batch in seen) == 6:
            done.set()
        return [item.upper() for item in items]

    clock = FakeClock()  # stands still: only full batches go until the test moves it
    config = BatcherConfig(max_batch_size=4, max_queue_delay_s=DELAY_S, priority_levels=2)
    with DynamicBatcher(run, config, clock=clock) as batcher:
        assert (
            batcher.queue_many(
                [("a", "s", 0, 0.0), ("b", "s", 1, 0.0), ("c", "s", 0, -1.0), ("d", "s", 1, 0.0)]
            )
            is None
        )
        # A future-less request shares batches with submitted ones.
        futures = batcher.submit_many([("e", "s", 0, 0.0)])
        batcher.queue_many([("f", "s", 0, 0.0)])
        clock.advance(DELAY_S)
        assert done.wait(SAFETY_NET_S)
        assert futures[0].result(SAFETY_NET_S) == "E"
    # The full batch went at once, most urgent level first, then the smaller order key.
    assert seen == [["b", "d", "c", "a"], ["e", "f"]]


def test_a_failed_batch_of_queued_requests_leaves_the_batcher_serving() -> None:
    calls: list[list[str]] = []

    def run(items: Sequence[str]) -> list[str]:
        calls.append(list(items))
        if "bad" in items:
            raise RuntimeError("teacher failed")
        return list(items)

    clock = FakeClock()
    config = BatcherConfig(max_batch_size=1, timeout_s=DELAY_S)
    with DynamicBatcher(run, config, clock=clock) as batcher:
        batcher.queue_many([("bad", None, 0, 0.0)])
        assert batcher.submit("good").result(SAFETY_NET_S) == "good"
    assert calls == [["bad"], ["good"]]
    with pytest.raises(BatcherClosedError):
        batcher.queue_many([("late", None, 0, 0.0)])
