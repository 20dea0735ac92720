"""Micro-batching across sources: one inference thread, each request on its own future.

A batch closes when it holds ``max_batch`` frames or when ``max_wait_s`` has passed
since its first frame arrived, whichever comes first. A lone frame on an idle agent
waits at most ``max_wait_s``; under load the batch fills before the wait ends.
The engine is read once per batch, so ``swap_engine`` takes effect between batches
and no frame is answered by a half-swapped model.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import numpy as np

from edge_agent.engine import Engine
from shared.errors import EdgeLoopError, ModelError

__all__ = ["BatchResult", "MicroBatcher", "WorkerPool"]

log = logging.getLogger(__name__)


class BatchResult:
    """Scores for one frame, with what produced them."""

    __slots__ = ("batch_size", "engine", "scores")

    def __init__(self, scores: np.ndarray, engine: Engine, batch_size: int) -> None:
        self.scores = scores
        self.engine = engine
        self.batch_size = batch_size


_Item = tuple[np.ndarray, "Future[BatchResult]"]


class MicroBatcher:
    """``with MicroBatcher(engine, max_batch=8, max_wait_s=0.005) as b: b.submit(frame)``."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 8,
        max_wait_s: float = 0.005,
        max_queue: int = 1024,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        # Bounded: a source that outruns inference is told so (queue.Full) instead of
        # growing memory; cameras keep only their newest frame anyway.
        self._queue: queue.Queue[_Item | None] = queue.Queue(max_queue)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.batches = 0
        self.frames = 0

    @property
    def engine(self) -> Engine:
        return self._engine

    def swap_engine(self, engine: Engine) -> None:
        """Serve the next batch with ``engine`` (the current batch finishes on the old one)."""
        self._engine = engine

    def start(self) -> MicroBatcher:
        self._thread = threading.Thread(target=self._loop, name="inference-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)
        # Anything still queued is answered, not left hanging.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item[1].done():
                item[1].set_exception(ModelError("the agent is stopping"))

    def __enter__(self) -> MicroBatcher:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def submit(
        self, frame: np.ndarray, *, block: bool = True, timeout: float = 5.0
    ) -> Future[BatchResult]:
        """Queue one uint8 [H, W, 3] frame; the future resolves with its scores."""
        if self._stopping.is_set():
            raise ModelError("the agent is stopping")
        future: Future[BatchResult] = Future()
        self._queue.put((frame, future), block=block, timeout=timeout)
        return future

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def _collect(self, first: _Item) -> list[_Item]:
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self._queue.get_nowait()
                    if remaining <= 0
                    else self._queue.get(timeout=remaining)
                )
            except queue.Empty:
                break
            if item is None:
                self._stopping.set()
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                first = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if first is None:
                break
            batch = self._collect(first)
            live = [(f, fut) for f, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            engine = self._engine
            try:
                scores = engine.run(np.stack([f for f, _ in live]))
            except EdgeLoopError as exc:
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            except Exception as exc:  # a bug in an engine must not kill the loop
                log.exception("inference failed")
                for _, fut in live:
                    fut.set_exception(ModelError(f"inference failed: {exc}"))
                continue
            self.batches += 1
            self.frames += len(live)
            for row, (_, fut) in zip(scores, live, strict=True):
                fut.set_result(BatchResult(row, engine, len(live)))


class WorkerPool:
    """A few named threads taking jobs from one queue: ``pool.submit(fn, *args)``.

    The per-frame stages (decoding an upload, routing an answer) hand over thousands
    of small jobs a second; a plain ``SimpleQueue`` costs a fraction of what an
    executor's futures and bookkeeping do, and these jobs report through their own
    futures anyway. A job that raises is logged; the thread keeps serving.
    """

    def __init__(self, workers: int, *, name: str) -> None:
        if workers < 1:
            raise ValueError("a worker pool needs at least one thread")
        self._jobs: queue.SimpleQueue[tuple[Callable[..., object], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread; RuntimeError once the pool is shut down."""
        if self._closed:
            raise RuntimeError("the worker pool is shut down")
        self._jobs.put((fn, args))

    def shutdown(self, *, wait: bool = True, timeout: float = 5.0) -> None:
        """Finish the queued jobs, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:
                log.exception("a %s job failed", threading.current_thread().name)
