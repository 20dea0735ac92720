"""Group commit for the forward path: forwarded samples gathered into spool transactions.

A forwarded frame is answered only once its sample is committed, so the writer
stores what has gathered in one ``Spool.write`` and then tells each caller; with an
uplink, the batch is published right after its commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from edge_agent.spool import NewSample, Spool
from shared.errors import StoreError
from shared.lifecycle import Workers

__all__ = ["SpoolWriter", "StoredCallback", "WriterUplink"]

log = logging.getLogger(__name__)


StoredCallback = Callable[[bool, BaseException | None], None]


class WriterUplink(Protocol):
    """How a ``SpoolWriter`` hands fresh samples straight to the link."""

    def begin(self) -> tuple[bool, list[str]]:
        """Before a batch's transaction: (publish it right after the commit?, receipts to
        apply in the same transaction)."""
        ...

    def end(
        self, published: bool, samples: list[NewSample], acked: list[str], removed: int | None
    ) -> None:
        """After the batch is answered: publish ``samples`` when ``published``; ``removed``
        is how many of ``acked`` were deleted, None when the transaction failed."""
        ...


class SpoolWriter:
    """Group commit for the forward path: samples from any thread, one transaction a batch.

    ``writer.submit(sample, done)`` queues a sample; the ``spool-writer`` thread stores
    what has gathered (waiting up to ``window_s`` after the first, or until
    ``max_batch`` are queued, or until ``expecting()`` says no more are on their way
    and ``nudge`` is called) in one transaction and then calls ``done(stored, error)``
    for each, in order: so whatever ``done`` tells a caller happens only once the
    sample is committed. With an ``uplink``, a batch is published right after its
    commit (stored as sent, so the pump does not read it back) and receipts held
    meanwhile are applied in the same transaction. After ``stop`` (which stores what is
    still queued first), ``submit`` stores on the caller's thread.
    """

    def __init__(
        self,
        spool: Spool,
        *,
        clock: Callable[[], float],
        window_s: float,
        max_batch: int = 64,
        uplink: WriterUplink | None = None,
        expecting: Callable[[], bool] | None = None,
    ) -> None:
        self.spool = spool
        self.uplink = uplink
        # Whether more samples may come for this batch (frames still being routed);
        # None: always gather for the whole window.
        self._expecting = expecting
        self.clock = clock
        self.window_s = window_s
        self.max_batch = max(1, max_batch)
        self._cond = threading.Condition()
        self._queue: list[tuple[NewSample, StoredCallback]] = []
        self._stopping = False
        self.workers = Workers("spool")  # thread spool-writer
        self.commits = 0
        self.samples = 0

    def start(self) -> SpoolWriter:
        self.workers.spawn("writer", self._run)
        return self

    def submit(self, sample: NewSample, done: StoredCallback) -> None:
        with self._cond:
            if not self._stopping:
                self._queue.append((sample, done))
                if len(self._queue) == 1 or len(self._queue) >= self.max_batch:
                    self._cond.notify()
                return
        self._store([(sample, done)])

    def store_now(self, batch: list[tuple[NewSample, StoredCallback]]) -> None:
        """Store ``batch`` in one transaction on the caller's thread, then tell each
        caller and publish, as the writer does with what it gathers (a thread that has
        a micro-batch's samples in hand saves the hand-over and the writer's wake-up)."""
        self._store(batch)

    def nudge(self) -> None:
        """Wake the writer to look again at ``expecting`` (nothing more is on its way)."""
        if not self._queue:  # nothing gathering (a stale read only delays to the window)
            return
        with self._cond:
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.workers.stop(timeout)
        with self._cond:
            left, self._queue = self._queue, []
        self._store(left)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                # Gather the rest of the micro-batch (its other forwarded frames are
                # being routed right now) before paying for a transaction; commit at
                # once when nothing else is on its way.
                deadline = time.monotonic() + self.window_s
                expecting = self._expecting
                while len(self._queue) < self.max_batch and not self._stopping:
                    if expecting is not None and not expecting():
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            self._store(batch)

    def _store(self, batch: list[tuple[NewSample, StoredCallback]]) -> None:
        if not batch:
            return
        samples = [sample for sample, _ in batch]
        publish, acked = self.uplink.begin() if self.uplink is not None else (False, [])
        removed: int | None = None
        fresh: list[NewSample] = []
        try:
            result = self.spool.write(samples, now=self.clock(), published=publish, acked=acked)
        except StoreError as exc:
            outcomes: list[tuple[bool, BaseException | None]] = [(False, exc)] * len(batch)
        else:
            self.commits += 1
            self.samples += len(batch)
            removed = result.removed
            outcomes = [(stored, None) for stored in result.stored]
            fresh = [
                sample for sample, stored in zip(samples, result.stored, strict=True) if stored
            ]
        for (_, done), (stored, error) in zip(batch, outcomes, strict=True):
            try:
                done(stored, error)
            except Exception:  # one caller's bug must not stop the writer
                log.exception("a spool-writer callback failed")
        if self.uplink is not None:
            try:
                self.uplink.end(publish, fresh, acked, removed)
            except Exception:
                log.exception("publishing freshly spooled samples failed")
