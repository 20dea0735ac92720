"""Micro-batching across sources: inference threads, answers handed over a batch at once.

A batch closes when it holds ``max_batch`` frames or when ``max_wait_s`` has passed
since its first frame arrived, whichever comes first. A lone frame on an idle agent
waits at most ``max_wait_s``; under load the batch fills before the wait ends.
The engine is read once per batch, so ``swap_engine`` takes effect between batches
and no frame is answered by a half-swapped model.

With ``threads`` > 1, that many batches are inferred at once, each on its own thread
(one thread at a time gathers the next batch): with a single-threaded session per run,
each core runs a batch of its own instead of every operator being split across the
cores and joined again, which is faster for many small operators on a busy device.
With ``pin``, each of them runs on a core of its own (``pin_to_core``).

Two ways in: ``submit`` gives each frame its own future (simple callers, tests);
``submit_job`` queues a frame with an opaque job, and every batch's jobs reach the
``on_batch`` handler together as one ``JobBatch``, so the agent routes and answers
a batch with one hand-over instead of a future, a callback and a thread wake-up
per frame.
"""

from __future__ import annotations

import functools
import logging
import os
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
from shared.lifecycle import Workers

__all__ = [
    "BatchHandler",
    "BatchResult",
    "DeferredFrame",
    "JobBatch",
    "MicroBatcher",
    "WorkerPool",
    "pin_to_core",
]

log = logging.getLogger(__name__)


def pin_to_core(index: int) -> int | None:
    """Run the calling thread on the ``index``-th core this process may use (in turn,
    when there are fewer); that core, or None where threads cannot be pinned.

    Several busy threads that hand the interpreter lock and batches to one another
    wake each other, and the kernel tends to queue the woken one on the waker's core,
    behind it, while another core idles: pinned, each keeps its own. The reference
    detector behind HTTP, two inference threads on two cores (``python -m bench.ab
    agent``, alternating rounds): 826 -> 915 frames/s with nothing forwarded, 752 ->
    789 at its default routing; the cores' idle share in a burst 12-14% -> 4%.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[index % len(cores)]
        os.sched_setaffinity(threading.get_native_id(), {core})
    except (AttributeError, OSError) as exc:  # not Linux, or a core taken away meanwhile
        log.warning("could not pin inference thread %d to a core: %s", index, exc)
        return None
    return core


class BatchResult:
    """Scores for one frame, with what produced them."""

    __slots__ = ("batch_size", "engine", "scores")

    def __init__(self, scores: np.ndarray, engine: Engine, batch_size: int) -> None:
        self.scores = scores
        self.engine = engine
        self.batch_size = batch_size


class JobBatch:
    """The jobs of one inference batch, with their score rows or the error that failed them.

    ``scores[i]`` belongs to ``jobs[i]``; ``size`` counts every frame of the batch
    (``submit`` futures included). On failure ``scores`` is None and ``error`` says why.
    """

    __slots__ = ("engine", "error", "jobs", "scores", "size")

    def __init__(
        self,
        jobs: list[Any],
        scores: np.ndarray | None,
        engine: Engine,
        size: int,
        error: BaseException | None = None,
    ) -> None:
        self.jobs = jobs
        self.scores = scores
        self.engine = engine
        self.size = size
        self.error = error


class DeferredFrame:
    """A frame prepared by the inference thread that takes it: ``make(input_hw, out)``
    writes the uint8 [h, w, 3] tensor into ``out``, its slot of the batch (an upload
    decoded there, not on a thread of its own, and into the batch, not beside it)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[tuple[int, int], np.ndarray], object]) -> None:
        self.make = make


BatchHandler = Callable[[JobBatch], None]
# (frame or a DeferredFrame, Future[BatchResult] or a job for on_batch)
_Item = tuple[Any, Any]


class _FrameQueue:
    """Frames waiting for inference; wakes the inference thread twice a batch at most.

    A producer wakes the consumer only for what it waits for: the first frame of a
    batch, then a full batch (or its deadline passes), not every frame as a queue
    would; each wake-up is a system call made while holding the GIL.
    """

    def __init__(self, max_items: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_items = max_items
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: list[_Item] = []
        self._wanted = 0  # how many frames the waiting consumer needs; 0: not waiting
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: _Item, block: bool, timeout: float) -> None:
        """Queue ``item``; while ``max_items`` wait, wait for room (or raise queue.Full).

        Raises ModelError once closed, so no frame is queued after the last drain.
        """
        if len(self._items) >= self.max_items:
            self._wait_for_room(block, timeout)
        with self._lock:
            if self._closed:  # stopped meanwhile: nobody would answer it
                raise ModelError("the agent is stopping")
            items = self._items
            items.append(item)
            if self._wanted and len(items) >= self._wanted:
                self._wanted = 0
                self._ready.notify()

    def _wait_for_room(self, block: bool, timeout: float) -> None:
        # Only when inference has fallen far behind: polling is cheap enough here.
        deadline = self._clock() + timeout
        while len(self._items) >= self.max_items:
            if not block or self._clock() >= deadline:
                raise queue.Full
            time.sleep(0.001)

    def next_batch(self, max_batch: int, max_wait_s: float, idle_s: float = 0.5) -> list[_Item]:
        """Up to ``max_batch`` frames: waits for a first one (``idle_s`` at most), then
        ``max_wait_s`` at most for the batch to fill. Empty when idle or closed."""
        with self._lock:
            if not self._items and not self._closed:
                self._wanted = 1
                self._ready.wait(idle_s)
            if not self._items or self._closed:
                self._wanted = 0
                return []
            deadline = self._clock() + max_wait_s
            while len(self._items) < max_batch and not self._closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    break
                self._wanted = max_batch
                self._ready.wait(remaining)
            self._wanted = 0
            batch = self._items[:max_batch]
            del self._items[:max_batch]
            return batch

    def close(self) -> None:
        """Wake the consumer for good; what is queued stays for ``take_all``."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()

    def take_all(self) -> list[_Item]:
        with self._lock:
            items, self._items = self._items, []
            return items


class MicroBatcher:
    """``with MicroBatcher(engine, max_batch=8, max_wait_s=0.005) as b: b.submit(frame)``.

    ``on_batch`` receives the jobs queued with ``submit_job``, one call per batch,
    on the inference thread: whatever it does there delays that thread's next batch
    (with one thread, hand the work over; with several, another infers meanwhile).
    ``clock`` (seconds, monotonic) times ``max_wait_s`` and the queue's ``timeout``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 8,
        max_wait_s: float = 0.005,
        max_queue: int = 1024,
        on_batch: BatchHandler | None = None,
        clock: Callable[[], float] = time.monotonic,
        threads: int = 1,
        pin: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self._engine = engine
        self._on_batch = on_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        # Bounded: a source that outruns inference is told so (queue.Full) instead of
        # growing memory; cameras keep only their newest frame anyway.
        self._queue = _FrameQueue(max_queue, clock)
        self.threads = threads
        self.pin = pin and threads > 1
        self.cores: list[int | None] = []  # each thread's core once pinned
        self.workers = Workers("inference")  # threads inference-loop, inference-loop-1, ...
        self._stopping = self.workers.stopping
        # One thread at a time gathers a batch; the others infer theirs meanwhile.
        self._gathering = threading.Lock()
        self._counting = threading.Lock()
        self.batches = 0
        self.frames = 0

    @property
    def engine(self) -> Engine:
        return self._engine

    def swap_engine(self, engine: Engine) -> None:
        """Serve the next batch with ``engine`` (the current batch finishes on the old one)."""
        self._engine = engine

    def start(self) -> MicroBatcher:
        for i in range(self.threads):
            loop = functools.partial(self._pinned_loop, i) if self.pin else self._loop
            self.workers.spawn("loop" if i == 0 else f"loop-{i}", loop)
        return self

    def _pinned_loop(self, index: int) -> None:
        core = pin_to_core(index)
        with self._counting:
            self.cores.append(core)
        self._loop()

    def health(self) -> dict[str, object]:
        return {"alive": self.workers.alive, "pending": self.pending}

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._queue.close()  # wakes the loop
        self.workers.stop(timeout)
        # Anything still queued is answered, not left hanging.
        left = self._queue.take_all()
        if left:
            self._fail(left, ModelError("the agent is stopping"))

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
        self._queue.put((frame, future), block, timeout)
        return future

    def submit_job(
        self,
        frame: np.ndarray | DeferredFrame,
        job: Any,
        *,
        block: bool = True,
        timeout: float = 5.0,
    ) -> None:
        """Queue one uint8 [H, W, 3] frame; ``job`` reaches ``on_batch`` with its scores.

        Raises ModelError once stopping and queue.Full when the queue stays full.
        """
        if self._on_batch is None:
            raise ValueError("submit_job needs a MicroBatcher made with on_batch")
        if self._stopping.is_set():
            raise ModelError("the agent is stopping")
        self._queue.put((frame, job), block, timeout)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._gathering:
                batch = self._queue.next_batch(self.max_batch, self.max_wait_s)
            if batch:
                self._run(batch)

    def _run(self, batch: list[_Item]) -> None:
        """Infer one batch and deliver its rows: to each future, and the jobs in one call."""
        live = [
            item
            for item in batch
            if not isinstance(item[1], Future) or item[1].set_running_or_notify_cancel()
        ]
        if not live:
            return
        engine = self._engine
        frames = [f for f, _ in live]
        if any(type(f) is DeferredFrame for f in frames):
            live, inputs = self._prepare(live, engine)
            if not live:
                return
        else:
            inputs = np.stack(frames)
        try:
            scores = engine.run(inputs)
        except EdgeLoopError as exc:
            self._fail(live, exc, engine)
            return
        except Exception as exc:  # a bug in an engine must not kill the loop
            log.exception("inference failed")
            self._fail(live, ModelError(f"inference failed: {exc}"), engine)
            return
        size = len(live)
        with self._counting:
            self.batches += 1
            self.frames += size
        jobs: list[Any] = []
        rows: list[int] = []
        for i, (_, target) in enumerate(live):
            if isinstance(target, Future):
                target.set_result(BatchResult(scores[i], engine, size))
            else:
                jobs.append(target)
                rows.append(i)
        if jobs:
            job_scores = scores if len(rows) == size else scores[rows]
            self._deliver(JobBatch(jobs, job_scores, engine, size))

    def _prepare(self, live: list[_Item], engine: Engine) -> tuple[list[_Item], np.ndarray]:
        """The batch's input, made here: each deferred frame decoded into its slot, the
        others copied into theirs; a frame that fails is answered alone.

        Written in place, the batch needs no stacking afterwards (a copy of every frame)
        and its frames no arrays of their own.
        """
        hw = engine.input_hw
        batch = np.empty((len(live), *hw, 3), np.uint8)
        kept: list[_Item] = []
        for item in live:
            frame, slot = item[0], batch[len(kept)]
            try:
                if type(frame) is DeferredFrame:
                    frame.make(hw, slot)
                else:
                    slot[...] = frame  # raises for a frame of another size (a swapped model)
            except Exception as exc:
                self._fail([item], exc, engine)
                continue
            kept.append(item)
        return kept, batch[: len(kept)]

    def _fail(self, items: list[_Item], error: BaseException, engine: Engine | None = None) -> None:
        jobs = []
        for _, target in items:
            if isinstance(target, Future):
                if not target.done():
                    target.set_exception(error)
            else:
                jobs.append(target)
        if jobs:
            self._deliver(JobBatch(jobs, None, engine or self._engine, len(items), error))

    def _deliver(self, batch: JobBatch) -> None:
        assert self._on_batch is not None  # submit_job refuses jobs without a handler
        try:
            self._on_batch(batch)
        except Exception:  # the handler answers its own jobs; the loop must go on
            log.exception("the batch handler failed")


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
        self._size = workers
        self.workers = Workers(name)  # threads {name}-0 .. {name}-{workers - 1}
        for i in range(workers):
            self.workers.spawn(str(i), self._work)

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
        for _ in range(self._size):
            self._jobs.put(None)
        if wait:
            self.workers.stop(timeout)

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
