"""Micro-batching: batches fill up to max_batch, a lone frame waits at most max_wait.

Batch forming is checked on a ``FakeClock``: with the clock standing still only a
full batch can go, and a partial batch goes once the test has moved the clock past
its wait. No assertion depends on how fast this machine is.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import pytest

from edge_agent.batcher import DeferredFrame, JobBatch, MicroBatcher
from edge_agent.imaging import ImageRejected
from shared.errors import ModelError
from tests.clocks import FakeClock

WAIT_S = 0.0625  # max_wait_s on a FakeClock: a power of two, so sums stay exact
SAFETY_NET_S = 30.0  # how long a future may take before the test gives up


class RecordingEngine:
    name = "rec"
    version = "1"
    labels = ["a", "b"]
    input_hw = (4, 4)
    provider = "cpu"

    def __init__(self, delay: float = 0.0) -> None:
        self.sizes: list[int] = []
        self.delay = delay

    def run(self, frames: np.ndarray) -> np.ndarray:
        self.sizes.append(len(frames))
        time.sleep(self.delay)
        first = frames[:, 0, 0, 0].astype(np.float32) / 255
        return np.stack([first, 1 - first], axis=1)


def frame(value: int) -> np.ndarray:
    return np.full((4, 4, 3), value, dtype=np.uint8)


def test_each_future_gets_its_own_row_and_full_batches_go_without_waiting() -> None:
    clock = FakeClock()  # never moves: only a full batch can go
    engine = RecordingEngine()
    with MicroBatcher(engine, max_batch=4, max_wait_s=WAIT_S, clock=clock) as batcher:
        futures = [batcher.submit(frame(v)) for v in range(12)]
        results = [f.result(SAFETY_NET_S) for f in futures]
    for value, result in enumerate(results):
        assert result.scores[0] == pytest.approx(value / 255)
        assert result.batch_size == 4
    assert engine.sizes == [4, 4, 4]  # batched across submits, none of them waited out


def test_a_lone_frame_goes_once_max_wait_has_passed_on_the_clock() -> None:
    clock = FakeClock()
    engine = RecordingEngine()
    with MicroBatcher(engine, max_batch=64, max_wait_s=WAIT_S, clock=clock) as batcher:
        future = batcher.submit(frame(1))
        # The loop reads the clock once the frame is there (its deadline, then what
        # is left of it); it reads nothing while idle.
        assert clock.wait_for_reads(2)
        clock.advance(WAIT_S / 2)
        reads = clock.reads
        assert clock.wait_for_reads(reads + 1)  # it looked again: half the wait is left
        assert not future.done()
        clock.advance(WAIT_S / 2)
        result = future.result(SAFETY_NET_S)
    assert result.batch_size == 1
    assert engine.sizes == [1]


def test_many_threads() -> None:
    engine = RecordingEngine(delay=0.005)
    errors: list[BaseException] = []
    with MicroBatcher(engine, max_batch=8, max_wait_s=0.005) as batcher:

        def client(v: int) -> None:
            for _ in range(20):
                try:
                    r = batcher.submit(frame(v)).result(SAFETY_NET_S)
                    assert r.scores[0] == pytest.approx(v / 255)
                except BaseException as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=client, args=(v,)) for v in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SAFETY_NET_S)
    assert not errors
    assert sum(engine.sizes) == 120


def test_engine_errors_reach_every_future() -> None:
    class Broken(RecordingEngine):
        def run(self, frames: np.ndarray) -> np.ndarray:
            raise ModelError("boom")

    with MicroBatcher(Broken(), max_batch=4, max_wait_s=0.01) as batcher:
        futures = [batcher.submit(frame(0)) for _ in range(3)]
        for f in futures:
            with pytest.raises(ModelError, match="boom"):
                f.result(SAFETY_NET_S)
        # The loop survived.
        assert batcher.pending == 0


def test_swap_between_batches() -> None:
    first, second = RecordingEngine(), RecordingEngine()
    with MicroBatcher(first, max_batch=2, max_wait_s=0.001) as batcher:
        assert batcher.submit(frame(1)).result(SAFETY_NET_S).engine is first
        batcher.swap_engine(second)
        assert batcher.submit(frame(1)).result(SAFETY_NET_S).engine is second


def test_submit_after_stop_is_refused() -> None:
    batcher = MicroBatcher(RecordingEngine()).start()
    batcher.stop()
    with pytest.raises(ModelError, match="stopping"):
        batcher.submit(frame(0))


class _Jobs:
    """An on_batch handler that records what each call delivered."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[object], list[float] | None, int, BaseException | None]] = []
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, batch: JobBatch) -> None:
        firsts = None if batch.scores is None else [float(r[0]) for r in batch.scores]
        self.calls.append((list(batch.jobs), firsts, batch.size, batch.error))
        if sum(len(c[0]) for c in self.calls) >= self.expected:
            self.done.set()


def test_jobs_reach_the_handler_a_batch_at_a_time_with_their_own_rows() -> None:
    jobs = _Jobs()
    jobs.expected = 7
    engine = RecordingEngine()
    clock = FakeClock()  # never moves: batches go when full
    with MicroBatcher(engine, max_batch=4, max_wait_s=WAIT_S, on_batch=jobs, clock=clock) as b:
        future = b.submit(frame(255))
        for v in range(7):
            b.submit_job(frame(v * 10), f"job-{v}")
        assert jobs.done.wait(SAFETY_NET_S)
        assert future.result(SAFETY_NET_S).scores[0] == pytest.approx(1.0)
    assert engine.sizes == [4, 4]
    assert len(jobs.calls) == 2  # one call per batch, not per frame
    delivered = [job for call in jobs.calls for job in call[0]]
    assert delivered == [f"job-{v}" for v in range(7)]
    assert [len(call[0]) for call in jobs.calls] == [3, 4]  # the future's frame rode along
    for call in jobs.calls:
        names, firsts, size, error = call
        assert error is None and size == 4
        assert firsts == pytest.approx([int(str(n)[4:]) * 10 / 255 for n in names])


def test_deferred_frames_are_made_by_the_inference_thread_and_a_failed_one_alone() -> None:
    jobs = _Jobs()
    jobs.expected = 4
    engine = RecordingEngine()
    clock = FakeClock()  # never moves: the batch goes when full
    made: list[tuple[tuple[int, int], str]] = []

    def deferred(value: int) -> DeferredFrame:
        def make(hw: tuple[int, int], out: np.ndarray) -> None:
            made.append((hw, threading.current_thread().name))
            if value == 20:
                raise ImageRejected("not an image", reason="undecodable")
            out[...] = value

        return DeferredFrame(make)

    with MicroBatcher(engine, max_batch=4, max_wait_s=WAIT_S, on_batch=jobs, clock=clock) as b:
        b.submit_job(frame(0), "job-0")  # a frame made beforehand rides along
        for v in (10, 20, 30):
            b.submit_job(deferred(v), f"job-{v}")
        assert jobs.done.wait(SAFETY_NET_S)
    assert made == [((4, 4), "inference-loop")] * 3  # at the engine's size, on its thread
    assert engine.sizes == [3]  # the failed frame is not inferred
    failed, inferred = jobs.calls
    assert failed[0] == ["job-20"] and isinstance(failed[3], ImageRejected)
    assert inferred[0] == ["job-0", "job-10", "job-30"] and inferred[3] is None
    assert inferred[1] == pytest.approx([0.0, 10 / 255, 30 / 255])


def test_a_failed_batch_and_a_stop_answer_every_job_with_the_error() -> None:
    class Broken(RecordingEngine):
        def run(self, frames: np.ndarray) -> np.ndarray:
            raise ModelError("boom")

    jobs = _Jobs()
    jobs.expected = 2
    with MicroBatcher(Broken(), max_batch=4, max_wait_s=0.01, on_batch=jobs) as batcher:
        batcher.submit_job(frame(0), "a")
        batcher.submit_job(frame(0), "b")
        assert jobs.done.wait(SAFETY_NET_S)
    assert all(isinstance(c[3], ModelError) and c[1] is None for c in jobs.calls)

    stopped = _Jobs()
    stopped.expected = 3
    batcher = MicroBatcher(RecordingEngine(), on_batch=stopped)  # never started
    for name in "xyz":
        batcher.submit_job(frame(0), name)
    assert batcher.pending == 3
    batcher.stop()
    assert [c[0] for c in stopped.calls] == [["x", "y", "z"]]
    assert "stopping" in str(stopped.calls[0][3])


def test_a_full_queue_refuses_at_once_or_once_the_timeout_has_passed() -> None:
    clock = FakeClock(step=0.01)  # each look at the time moves it on by 10 ms
    # Never started: nothing leaves the queue.
    batcher = MicroBatcher(RecordingEngine(), max_queue=2, on_batch=_Jobs(), clock=clock)
    batcher.submit_job(frame(0), "a")
    batcher.submit(frame(0))
    reads = clock.reads
    with pytest.raises(queue.Full):
        batcher.submit_job(frame(0), "c", block=False)
    assert clock.reads <= reads + 1  # refused on its first look, without waiting
    started = clock.now
    with pytest.raises(queue.Full):
        batcher.submit(frame(0), timeout=0.05)
    assert clock.now >= started + 0.05  # gave up once its timeout had passed on the clock
    assert batcher.pending == 2
    batcher.stop()


def test_submit_job_needs_a_handler() -> None:
    with MicroBatcher(RecordingEngine()) as batcher, pytest.raises(ValueError, match="on_batch"):
        batcher.submit_job(frame(0), "job")


class GatedEngine(RecordingEngine):
    """Holds each batch until ``release`` is set; says when ``inflight`` batches run at once."""

    def __init__(self, inflight: int) -> None:
        super().__init__()
        self.release = threading.Event()
        self.all_running = threading.Event()
        self._inflight = inflight
        self._running = 0
        self._lock = threading.Lock()
        self.affinities: list[set[int]] = []  # the cores each batch's thread may run on

    def run(self, frames: np.ndarray) -> np.ndarray:
        with self._lock:
            if hasattr(os, "sched_getaffinity"):
                self.affinities.append(os.sched_getaffinity(threading.get_native_id()))
            self._running += 1
            if self._running == self._inflight:
                self.all_running.set()
        assert self.release.wait(SAFETY_NET_S)
        return super().run(frames)


def test_inference_threads_infer_batches_at_once_and_answer_every_frame() -> None:
    clock = FakeClock()  # never moves: only full batches go
    engine = GatedEngine(inflight=2)
    with MicroBatcher(engine, max_batch=4, max_wait_s=WAIT_S, clock=clock, threads=2) as batcher:
        futures = [batcher.submit(frame(v)) for v in range(8)]
        # Both batches are in the engine together: the second did not wait for the first.
        assert engine.all_running.wait(SAFETY_NET_S)
        assert not any(f.done() for f in futures)
        engine.release.set()
        results = [f.result(SAFETY_NET_S) for f in futures]
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("inference"))
    for value, result in enumerate(results):
        assert result.scores[0] == pytest.approx(value / 255)
        assert result.batch_size == 4
    assert engine.sizes == [4, 4]
    assert batcher.batches == 2 and batcher.frames == 8
    assert names == ["inference-loop", "inference-loop-1"]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux and two cores",
)
def test_pinned_inference_threads_each_run_on_a_core_of_their_own() -> None:
    engine = GatedEngine(inflight=2)
    cores = sorted(os.sched_getaffinity(0))
    with MicroBatcher(
        engine, max_batch=4, max_wait_s=WAIT_S, clock=FakeClock(), threads=2, pin=True
    ) as batcher:
        futures = [batcher.submit(frame(v)) for v in range(8)]
        assert engine.all_running.wait(SAFETY_NET_S)
        engine.release.set()
        for future in futures:
            future.result(SAFETY_NET_S)
    assert sorted(c for c in batcher.cores if c is not None) == cores[:2]
    assert sorted(engine.affinities) == [{cores[0]}, {cores[1]}]
    assert os.sched_getaffinity(0) == set(cores)  # the rest of the process is not pinned


def test_inference_threads_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="threads"):
        MicroBatcher(RecordingEngine(), threads=0)
