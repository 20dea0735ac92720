"""Micro-batching: batches fill up to max_batch, a lone frame waits at most max_wait."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from edge_agent.batcher import JobBatch, MicroBatcher
from shared.errors import ModelError


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


def test_each_future_gets_its_own_row() -> None:
    engine = RecordingEngine(delay=0.02)
    with MicroBatcher(engine, max_batch=4, max_wait_s=0.05) as batcher:
        futures = [batcher.submit(frame(v)) for v in range(10)]
        results = [f.result(5) for f in futures]
    for value, result in enumerate(results):
        assert result.scores[0] == pytest.approx(value / 255)
    assert max(engine.sizes) <= 4
    assert sum(engine.sizes) == 10
    assert len(engine.sizes) < 10  # batched across submitters


def test_lone_frame_waits_at_most_max_wait() -> None:
    engine = RecordingEngine()
    with MicroBatcher(engine, max_batch=64, max_wait_s=0.01) as batcher:
        batcher.submit(frame(0)).result(5)  # warm the thread
        start = time.perf_counter()
        batcher.submit(frame(1)).result(5)
        assert time.perf_counter() - start < 0.2


def test_many_threads() -> None:
    engine = RecordingEngine(delay=0.005)
    errors: list[BaseException] = []
    with MicroBatcher(engine, max_batch=8, max_wait_s=0.005) as batcher:

        def client(v: int) -> None:
            for _ in range(20):
                try:
                    r = batcher.submit(frame(v)).result(5)
                    assert r.scores[0] == pytest.approx(v / 255)
                except BaseException as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=client, args=(v,)) for v in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
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
                f.result(5)
        # The loop survived.
        assert batcher.pending == 0


def test_swap_between_batches() -> None:
    first, second = RecordingEngine(), RecordingEngine()
    with MicroBatcher(first, max_batch=2, max_wait_s=0.001) as batcher:
        assert batcher.submit(frame(1)).result(5).engine is first
        batcher.swap_engine(second)
        assert batcher.submit(frame(1)).result(5).engine is second


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
    jobs.expected = 8
    engine = RecordingEngine(delay=0.02)
    with MicroBatcher(engine, max_batch=4, max_wait_s=0.05, on_batch=jobs) as batcher:
        futures = [batcher.submit(frame(255))]
        for v in range(8):
            batcher.submit_job(frame(v * 10), f"job-{v}")
        assert jobs.done.wait(5)
        assert futures[0].result(5).scores[0] == pytest.approx(1.0)
    assert len(jobs.calls) == len(engine.sizes) < 9  # one call per batch, not per frame
    delivered = [job for call in jobs.calls for job in call[0]]
    assert delivered == [f"job-{v}" for v in range(8)]
    for call in jobs.calls:
        names, firsts, size, error = call
        assert error is None and size >= len(names)
        assert firsts == pytest.approx([int(str(n)[4:]) * 10 / 255 for n in names])


def test_a_failed_batch_and_a_stop_answer_every_job_with_the_error() -> None:
    class Broken(RecordingEngine):
        def run(self, frames: np.ndarray) -> np.ndarray:
            raise ModelError("boom")

    jobs = _Jobs()
    jobs.expected = 2
    with MicroBatcher(Broken(), max_batch=4, max_wait_s=0.01, on_batch=jobs) as batcher:
        batcher.submit_job(frame(0), "a")
        batcher.submit_job(frame(0), "b")
        assert jobs.done.wait(5)
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


def test_a_full_queue_refuses_at_once_without_blocking() -> None:
    batcher = MicroBatcher(RecordingEngine(), max_queue=2, on_batch=_Jobs())  # never started
    batcher.submit_job(frame(0), "a")
    batcher.submit(frame(0))
    with pytest.raises(queue.Full):
        batcher.submit_job(frame(0), "c", block=False)
    started = time.monotonic()
    with pytest.raises(queue.Full):
        batcher.submit(frame(0), timeout=0.05)
    assert time.monotonic() - started < 1.0
    batcher.stop()


def test_submit_job_needs_a_handler() -> None:
    with MicroBatcher(RecordingEngine()) as batcher, pytest.raises(ValueError, match="on_batch"):
        batcher.submit_job(frame(0), "job")
