"""A dynamic batcher with Triton's knobs, independent of MQTT and of the model.

Requests are submitted with a shape key, a priority level and an order key; worker
threads form batches and call ``run_batch(items) -> results`` (one result per item,
in order). How a batch is formed, following Triton's dynamic batcher:

* Only requests with the same shape key share a batch (a tensor has one shape).
* The next batch starts from the most urgent waiting request: the highest priority
  level (``priority_levels - 1`` is the most urgent), then the smallest order key
  (the verifier passes the edge's confidence: least sure first), then arrival.
* If as many same-shape requests wait as the largest preferred batch size (or
  ``max_batch_size`` when none are given), the batch goes at once with the largest
  preferred size that fits. Otherwise the batcher waits until the oldest of them
  has waited ``max_queue_delay_s``, then sends what is there (up to max_batch_size).
* ``max_queue_size`` bounds the waiting requests. At the bound, policy "reject"
  fails ``submit`` at once with QueueFullError; "delay" blocks the submitter until
  there is room, or fails after ``submit_timeout_s``.
* ``timeout_s``: a request still waiting after this long fails with
  QueueTimeoutError instead of running late.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from shared.errors import EdgeLoopError
from shared.lifecycle import Workers

__all__ = [
    "BatchInfo",
    "BatcherClosedError",
    "BatcherConfig",
    "DynamicBatcher",
    "QueueFullError",
    "QueueTimeoutError",
]

T = TypeVar("T")
R = TypeVar("R")


class QueueFullError(EdgeLoopError):
    reason = "queue_full"


class QueueTimeoutError(EdgeLoopError):
    reason = "queue_timeout"


class BatcherClosedError(EdgeLoopError):
    reason = "closed"


@dataclass(frozen=True)
class BatcherConfig:
    """Triton's dynamic_batching knobs."""

    max_batch_size: int = 32
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.005
    priority_levels: int = 10
    max_queue_size: int = 10_000
    queue_policy: Literal["reject", "delay"] = "delay"
    submit_timeout_s: float | None = 30.0
    timeout_s: float | None = None
    instances: int = 1

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if any(s < 1 or s > self.max_batch_size for s in self.preferred_batch_sizes):
            raise ValueError("preferred batch sizes must lie in 1..max_batch_size")
        if self.priority_levels < 1 or self.instances < 1 or self.max_queue_size < 1:
            raise ValueError("priority_levels, instances and max_queue_size must be positive")

    @property
    def _preferred(self) -> tuple[int, ...]:
        return tuple(sorted(self.preferred_batch_sizes)) or (self.max_batch_size,)


@dataclass(frozen=True)
class BatchInfo:
    """What one executed batch looked like (for metrics)."""

    size: int
    shape: Hashable
    queue_delays_s: tuple[float, ...]
    compute_s: float
    failed: bool


@dataclass(slots=True, eq=False)
class _Request(Generic[T, R]):
    item: T
    shape: Hashable
    level: int
    enqueued: float
    deadline: float | None
    future: Future[R] | None  # None: queued with ``queue_many``, nobody waits on it
    taken: bool = False


# A heap entry: (order key, arrival, request). Plain tuples compare in C, where the
# requests' own dataclass-generated __lt__ ran in Python on every heap comparison.
_Entry = tuple[float, int, "_Request[T, R]"]


class DynamicBatcher(Generic[T, R]):
    """Batches submitted items by shape and priority and runs them on worker threads."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R]],
        config: BatcherConfig | None = None,
        *,
        on_batch: Callable[[BatchInfo], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "batcher",
    ) -> None:
        self.config = config or BatcherConfig()
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._clock = clock
        self._name = name
        mutex = threading.Lock()
        # Two conditions on one lock: workers wait for work, "delay" submitters for room.
        self._lock = threading.Condition(mutex)
        self._room = threading.Condition(mutex)
        # (level, shape) -> heap of entries; lazily cleaned of taken ones.
        self._heaps: dict[tuple[int, Hashable], list[_Entry[T, R]]] = {}
        self._per_shape: dict[Hashable, int] = {}
        self._deadlines: list[tuple[float, int, _Request[T, R]]] = []
        self._waiting = 0
        self._seq = itertools.count()
        self._closed = False
        self._workers = Workers(name)  # threads {name}-0 .. {name}-{instances - 1}

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> DynamicBatcher[T, R]:
        for index in range(self.config.instances):
            self._workers.spawn(str(index), self._worker)
        return self

    def close(self, *, drain: bool = True, timeout: float = 10.0) -> None:
        """Stop accepting; run what waits (``drain``) or fail it, then join the workers."""
        with self._lock:
            self._closed = True
            if not drain:
                for heap in self._heaps.values():
                    for _order, _seq, request in heap:
                        if not request.taken:
                            request.taken = True
                            _fail(request, BatcherClosedError("batcher closed"))
                self._heaps.clear()
                self._per_shape.clear()
                self._waiting = 0
            self._lock.notify_all()
        self._workers.stop(timeout)

    def __enter__(self) -> DynamicBatcher[T, R]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether a worker thread still runs (after ``close``: still draining)."""
        return any(worker.alive for worker in self._workers.health().values())

    def health(self) -> dict[str, object]:
        return {"running": self.running, "waiting": self._waiting, "closed": self._closed}

    @property
    def depth(self) -> int:
        """Requests waiting to be batched."""
        return self._waiting

    # --- submitting ----------------------------------------------------------

    def submit(
        self, item: T, *, shape: Hashable = None, priority: int = 0, order: float = 0.0
    ) -> Future[R]:
        """Queue ``item``; its future completes with its result or the batch's error."""
        return self.submit_many([(item, shape, priority, order)])[0]

    def submit_many(self, requests: Sequence[tuple[T, Hashable, int, float]]) -> list[Future[R]]:
        """Queue several (item, shape, priority, order) at once: one lock and one wake-up
        of the workers for all of them, as ``submit`` would queue each. If one cannot be
        queued (closed, full), the error is raised and those before it stay queued."""
        futures: list[Future[R]] = []
        with self._lock:
            for item, shape, priority, order in requests:
                self._wait_for_room()
                future: Future[R] = Future()
                self._enqueue(item, shape, priority, order, future)
                futures.append(future)
            self._lock.notify()
        return futures

    def queue_many(self, requests: Sequence[tuple[T, Hashable, int, float]]) -> None:
        """``submit_many`` without a future per request, for a ``run_batch`` that hands
        its results on itself: a future costs a lock and a condition to make and to
        settle, which at thousands of requests a second is a share of a core."""
        with self._lock:
            for item, shape, priority, order in requests:
                self._wait_for_room()
                self._enqueue(item, shape, priority, order, None)
            self._lock.notify()

    def _wait_for_room(self) -> None:
        """Under the lock: return once one more request fits, or raise per the policy."""
        if self._closed:
            raise BatcherClosedError("the batcher is closed")
        if self._waiting < self.config.max_queue_size:
            return
        if self.config.queue_policy == "reject":
            raise QueueFullError(
                f"the verifier queue is full ({self.config.max_queue_size} waiting)"
            )
        deadline = (
            None
            if self.config.submit_timeout_s is None
            else self._clock() + self.config.submit_timeout_s
        )
        self._lock.notify()  # what is queued already must be able to run meanwhile
        while self._waiting >= self.config.max_queue_size and not self._closed:
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                raise QueueFullError(
                    f"the verifier queue stayed full ({self.config.max_queue_size}"
                    f" waiting) for {self.config.submit_timeout_s} s"
                )
            self._room.wait(remaining)
        if self._closed:
            raise BatcherClosedError("the batcher is closed")

    def _enqueue(
        self, item: T, shape: Hashable, priority: int, order: float, future: Future[R] | None
    ) -> None:
        level = min(max(int(priority), 0), self.config.priority_levels - 1)
        now = self._clock()
        seq = next(self._seq)
        timeout = self.config.timeout_s
        request: _Request[T, R] = _Request(
            item=item,
            shape=shape,
            level=level,
            enqueued=now,
            deadline=None if timeout is None else now + timeout,
            future=future,
        )
        heapq.heappush(self._heaps.setdefault((level, shape), []), (order, seq, request))
        self._per_shape[shape] = self._per_shape.get(shape, 0) + 1
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, seq, request))
        self._waiting += 1

    # --- forming batches -----------------------------------------------------

    def _head(self, heap: list[_Entry[T, R]]) -> _Request[T, R] | None:
        while heap and heap[0][2].taken:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _take(self, request: _Request[T, R]) -> None:
        request.taken = True
        self._waiting -= 1
        left = self._per_shape[request.shape] - 1
        if left:
            self._per_shape[request.shape] = left
        else:
            del self._per_shape[request.shape]

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if not request.taken:
                self._take(request)
                _fail(
                    request,
                    QueueTimeoutError(f"request waited over {self.config.timeout_s} s in queue"),
                )
                self._room.notify_all()

    def _most_urgent(self) -> _Request[T, R] | None:
        best: tuple[int, float, int, _Request[T, R]] | None = None
        for (level, _shape), heap in self._heaps.items():
            head = self._head(heap)
            if head is None:
                continue
            order, seq, _ = heap[0]
            if best is None or (-level, order, seq) < best[:3]:
                best = (-level, order, seq, head)
        return None if best is None else best[3]

    def _collect(self, shape: Hashable, count: int) -> list[_Request[T, R]]:
        batch: list[_Request[T, R]] = []
        for level in range(self.config.priority_levels - 1, -1, -1):
            heap = self._heaps.get((level, shape))
            while heap and len(batch) < count:
                request = heapq.heappop(heap)[2]
                if not request.taken:
                    self._take(request)
                    batch.append(request)
            if heap is not None and not heap:
                del self._heaps[(level, shape)]
            if len(batch) >= count:
                break
        return batch

    def _oldest(self, shape: Hashable) -> float:
        oldest = float("inf")
        for (_level, s), heap in self._heaps.items():
            if s == shape:
                for _order, _seq, request in heap:
                    if not request.taken and request.enqueued < oldest:
                        oldest = request.enqueued
        return oldest

    def _next_batch(self) -> list[_Request[T, R]] | None:
        """Block until a batch is due; None once closed and drained."""
        preferred = self.config._preferred
        with self._lock:
            while True:
                now = self._clock()
                self._expire(now)
                head = self._most_urgent()
                if head is None:
                    if self._closed:
                        return None
                    self._lock.wait(self._wait_for(None, now))
                    continue
                waiting = self._per_shape.get(head.shape, 0)
                if waiting >= preferred[-1]:
                    size = max(s for s in preferred if s <= waiting)
                    return self._dispatch(head.shape, size)
                due = self._oldest(head.shape) + self.config.max_queue_delay_s
                if now >= due or self._closed:
                    # The delay is over: send what is there, as Triton does; waiting
                    # longer for a preferred size would only add latency.
                    return self._dispatch(head.shape, min(waiting, self.config.max_batch_size))
                self._lock.wait(self._wait_for(due, now))

    def _wait_for(self, due: float | None, now: float) -> float | None:
        candidates = [d for d in (due,) if d is not None]
        if self._deadlines:
            candidates.append(self._deadlines[0][0])
        if not candidates:
            return None
        return max(min(candidates) - now, 0.0)

    def _dispatch(self, shape: Hashable, size: int) -> list[_Request[T, R]]:
        batch = self._collect(shape, size)
        self._room.notify_all()
        return batch

    def _worker(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            started = self._clock()
            delays = tuple(started - r.enqueued for r in batch)
            failed = False
            try:
                results = self._run_batch([r.item for r in batch])
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"run_batch returned {len(results)} results for {len(batch)} items"
                    )
            except BaseException as exc:  # a failed batch fails its requests, not the worker
                failed = True
                for request in batch:
                    _fail(request, exc)
            else:
                for request, result in zip(batch, results, strict=True):
                    if request.future is not None:
                        request.future.set_result(result)
            if self._on_batch is not None:
                info = BatchInfo(
                    size=len(batch),
                    shape=batch[0].shape,
                    queue_delays_s=delays,
                    compute_s=self._clock() - started,
                    failed=failed,
                )
                with contextlib.suppress(Exception):  # metrics must never stop the batcher
                    self._on_batch(info)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"waiting": self._waiting, "shapes": dict(self._per_shape)}


def _fail(request: _Request[T, R], error: BaseException) -> None:
    if request.future is not None:
        request.future.set_exception(error)
