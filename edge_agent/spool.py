"""The disk spool in front of MQTT: a forwarded sample lives here until its receipt.

SQLite in WAL mode, one row per sample (the whole envelope as a blob). A sample is
deleted only by ``ack`` (the cloud's receipt for its id), never by a broker PUBACK;
``due`` hands out samples never sent or sent longer ago than the resend timeout,
and ``reset_sent`` makes everything due again after a reconnect. Bounded by bytes
and by count: to make room, audit samples go first (oldest first), then the oldest
of the rest; each eviction is counted by kind.

Writes come in batches, one transaction each: ``write`` stores a micro-batch of
forwarded samples (``put_many``), marks what was published as sent and deletes what
was receipted, all in one transaction; ``SpoolWriter`` gathers the forward path's
samples into such batches. A batch is exactly the same as the single writes in its
order: the same rows, evictions, counters and return values, and all of it or none
is committed.

Pages are 4 KiB, SQLite's default, chosen by measurement (``python -m bench.spool``,
in ``make bench``): the forward path writes each inference batch's forwarded samples
in one transaction, so most transactions hold one or two samples, and every page a
transaction touches (the row's, the two indexes', the counters') goes to the WAL
whole. Per sample, with the receipt and verdict that follow it, larger pages cost
about as much CPU or more and write more bytes (``docs/performance.md``, spool);
4 KiB pages write the least, and bytes written are what wears an SD card. Large
pages pay off only for transactions of many samples, which the agent makes only when
it forwards most frames. An existing spool keeps its page size. Deletes do not zero the pages
they free (``connect``): with zeroing, a receipt wrote the sample's payload again.

Durability: WAL with synchronous=NORMAL, so a committed sample survives a crash of
the agent process; a power cut may lose the last commits (FULL would fsync each
one, too slow for SD cards).

Thread-safe: one connection guarded by a lock (SQLite writes serialise anyway).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.errors import StoreError
from shared.lifecycle import Workers

log = logging.getLogger(__name__)

__all__ = [
    "PAGE_SIZE",
    "NewSample",
    "Spool",
    "SpoolStats",
    "SpoolWriter",
    "SpooledSample",
    "WriteResult",
    "WriterUplink",
    "connect",
]

PAGE_SIZE = 4096
_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sample_id TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    priority INTEGER NOT NULL,
    audit INTEGER NOT NULL,
    size INTEGER NOT NULL,
    sent_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_due ON samples (sent_at, priority, seq);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def connect(path: Path, *, page_size: int, timeout: float = 5.0) -> sqlite3.Connection:
    """A connection to one of the agent's SQLite files (the spool, the verdict store).

    ``page_size`` applies to a new file only; WAL and synchronous=NORMAL as the module
    docstring says. Deletes do not zero the pages they free: Debian's SQLite (and
    others built with SQLITE_SECURE_DELETE) does by default, and a receipted sample
    then cost its whole payload again in writes (`make bench`, spool section: FAST
    clears deleted content only from pages a delete writes anyway, and writes a small
    fraction of those bytes).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=timeout)
    db.execute(f"PRAGMA page_size={int(page_size)}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA secure_delete=FAST")
    return db


@dataclass(frozen=True)
class SpooledSample:
    sample_id: str
    payload: bytes
    priority: int
    attempts: int


@dataclass(frozen=True)
class NewSample:
    """One sample for ``put_many``."""

    sample_id: str
    payload: bytes
    priority: int
    audit: bool


@dataclass(frozen=True)
class WriteResult:
    """What ``Spool.write`` did: per new sample whether it is stored, and receipts applied."""

    stored: list[bool]
    removed: int


@dataclass(frozen=True)
class SpoolStats:
    depth: int
    bytes: int
    unsent: int
    evicted_audit: int
    evicted_oldest: int
    acked: int
    stored: int
    refused: int


class Spool:
    """``Spool(path, max_bytes=..., max_samples=...)``; ``close()`` when done.

    ``page_size`` applies to a new file only (an existing one keeps its pages).
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 256 << 20,
        max_samples: int = 100_000,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self._lock = threading.Lock()
        try:
            # Only a new file takes the page size (see the module docstring); an existing
            # spool keeps its own.
            self._db = connect(self.path, page_size=page_size)
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the spool at {self.path}: {exc}") from exc
        self._bytes, self._depth = self._db.execute(
            "SELECT COALESCE(SUM(size), 0), COUNT(*) FROM samples"
        ).fetchone()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- counters (persisted, so they survive restarts like the samples do) ----------

    def _bump(self, name: str, by: int = 1) -> None:
        self._db.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?)"
            " ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, by),
        )

    def _counter(self, name: str) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    # --- writing -------------------------------------------------------------------

    def put(
        self, sample_id: str, payload: bytes, *, priority: int, audit: bool, now: float
    ) -> bool:
        """Store a sample, evicting to make room; False if it can never fit (counted)."""
        return self.put_many([NewSample(sample_id, payload, priority, audit)], now=now)[0]

    def put_many(self, samples: Sequence[NewSample], *, now: float) -> list[bool]:
        """Store samples in one transaction, as ``put`` one after another would.

        Per sample: True when it is in the spool once this returns (or was already:
        a repeated id is stored once), False when it can never fit (counted). Either
        all of the batch is committed or none (StoreError).
        """
        return self.write(samples, now=now).stored

    def write(
        self,
        samples: Sequence[NewSample] = (),
        *,
        now: float,
        published: bool = False,
        sent: Iterable[str] = (),
        acked: Iterable[str] = (),
    ) -> WriteResult:
        """One transaction: store ``samples`` (as ``put_many``), mark ``sent``, delete ``acked``.

        ``published``: the new samples are handed to the link right after this commit,
        so they are stored as sent at ``now`` (due again after the resend timeout, or
        at once after ``reset_sent``), and no ``due`` call reads them back.
        A sample both sent and acked is deleted (the receipt wins).
        """
        sent_ids, acked_ids = list(sent), list(acked)
        if not samples and not sent_ids and not acked_ids:
            return WriteResult([], 0)
        stored: list[bool] = []
        counts = {"stored": 0, "refused": 0, "evicted_audit": 0, "evicted_oldest": 0}
        removed, freed = 0, 0
        sent_at, attempts = (now, 1) if published else (None, 0)
        with self._lock:
            depth, total = self._depth, self._bytes
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for sample in samples:
                    size = len(sample.payload)
                    if size > self.max_bytes:
                        counts["refused"] += 1
                        stored.append(False)
                        continue
                    depth, total = self._make_room(size, depth, total, counts)
                    cursor = self._db.execute(
                        "INSERT OR IGNORE INTO samples (sample_id, created_at, priority, audit,"
                        " size, sent_at, attempts, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            sample.sample_id,
                            now,
                            sample.priority,
                            int(sample.audit),
                            size,
                            sent_at,
                            attempts,
                            sample.payload,
                        ),
                    )
                    if cursor.rowcount == 1:  # 0: the id is already spooled
                        counts["stored"] += 1
                        depth += 1
                        total += size
                    stored.append(True)
                for chunk in _chunks(sent_ids):
                    marks = ",".join("?" * len(chunk))
                    self._db.execute(
                        "UPDATE samples SET sent_at = ?, attempts = attempts + 1"
                        f" WHERE sample_id IN ({marks})",
                        [now, *chunk],
                    )
                for chunk in _chunks(acked_ids):
                    marks = ",".join("?" * len(chunk))
                    row = self._db.execute(
                        "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM samples"
                        f" WHERE sample_id IN ({marks})",
                        chunk,
                    ).fetchone()
                    if row[0]:
                        self._db.execute(f"DELETE FROM samples WHERE sample_id IN ({marks})", chunk)
                    removed += int(row[0])
                    freed += int(row[1])
                if acked_ids:
                    counts["acked"] = removed
                for name, by in counts.items():
                    if by or name == "acked":
                        self._bump(name, by)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise StoreError(f"spool write failed: {exc}") from exc
            self._depth, self._bytes = depth - removed, total - freed
        return WriteResult(stored, removed)

    def _make_room(
        self, size: int, depth: int, total: int, counts: dict[str, int]
    ) -> tuple[int, int]:
        while depth and (total + size > self.max_bytes or depth + 1 > self.max_samples):
            row = self._db.execute(
                "SELECT seq, size, audit FROM samples ORDER BY audit DESC, seq ASC LIMIT 1"
            ).fetchone()
            if row is None:
                break
            self._db.execute("DELETE FROM samples WHERE seq = ?", (row[0],))
            counts["evicted_audit" if row[2] else "evicted_oldest"] += 1
            total -= row[1]
            depth -= 1
        return depth, total

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")

    def ack(self, sample_ids: Iterable[str]) -> int:
        """Delete receipted samples; returns how many were still here."""
        return self.settle(acked=sample_ids)

    def settle(
        self, *, sent: Iterable[str] = (), acked: Iterable[str] = (), now: float = 0.0
    ) -> int:
        """Mark ``sent`` as sent at ``now`` and delete ``acked`` in one transaction; how
        many of ``acked`` were still here."""
        return self.write(now=now, sent=sent, acked=acked).removed

    # --- sending -------------------------------------------------------------------

    def due(self, *, now: float, resend_after_s: float, limit: int = 100) -> list[SpooledSample]:
        """Samples to (re)publish: never sent, or sent over ``resend_after_s`` ago; urgent first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT sample_id, payload, priority, attempts FROM samples"
                " WHERE sent_at IS NULL OR sent_at <= ? ORDER BY priority, seq LIMIT ?",
                (now - resend_after_s, limit),
            ).fetchall()
        return [SpooledSample(r[0], bytes(r[1]), r[2], r[3]) for r in rows]

    def mark_sent(self, sample_ids: Iterable[str], *, now: float) -> None:
        """Mark samples as published at ``now`` (one transaction for the lot)."""
        self.settle(sent=sample_ids, now=now)

    def reset_sent(self) -> None:
        """Make every sample due now (after a reconnect: what was in flight may be lost)."""
        with self._lock:
            self._db.execute("UPDATE samples SET sent_at = NULL WHERE sent_at IS NOT NULL")

    # --- reading -------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return self._depth

    def ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT sample_id FROM samples ORDER BY seq")]

    def stats(self) -> SpoolStats:
        with self._lock:
            unsent = self._db.execute(
                "SELECT COUNT(*) FROM samples WHERE sent_at IS NULL"
            ).fetchone()[0]
            return SpoolStats(
                depth=self._depth,
                bytes=self._bytes,
                unsent=int(unsent),
                evicted_audit=self._counter("evicted_audit"),
                evicted_oldest=self._counter("evicted_oldest"),
                acked=self._counter("acked"),
                stored=self._counter("stored"),
                refused=self._counter("refused"),
            )


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


def _chunks(ids: list[str], size: int = 500) -> Iterable[list[str]]:
    """Slices of ``ids`` small enough for SQLite's limit on bound parameters."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]
