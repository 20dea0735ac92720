"""The disk spool in front of MQTT: a forwarded sample lives here until its receipt.

SQLite in WAL mode, one row per sample; its envelope is appended to a segment file
of the payload log beside it (``edge_agent.payload_log``: one system call for a
transaction's envelopes, no payload bytes through SQLite's pages). A sample is
deleted only by ``ack`` (the cloud's receipt for its id), never by a broker PUBACK;
``due`` hands out samples never sent or sent longer ago than the resend timeout,
and ``reset_sent`` makes everything due again after a reconnect. Bounded by bytes
and by count: to make room, audit samples go first (oldest first), then the oldest
of the rest; each eviction is counted by kind.

Writes come in batches, one transaction each: ``write`` stores a micro-batch of
forwarded samples (``put_many``), marks what was published as sent and deletes what
was receipted, all in one transaction; ``edge_agent.spool_writer.SpoolWriter``
gathers the forward path's samples into such batches. A batch is exactly the same as
the single writes in its order: the same rows, evictions, counters and return
values, and all of it or none is committed.

Pages are 4 KiB, SQLite's default, chosen by measurement (``python -m bench.spool``,
in ``make bench``): the forward path writes each inference batch's forwarded samples
in one transaction, so most transactions hold one or two samples, and every page a
transaction touches (the row's, the two indexes', the counters') goes to the WAL
whole; larger pages cost as much CPU or more and write more bytes
(``docs/performance.md``, spool), and bytes written are what wears an SD card. An
existing spool keeps its page size. Deletes do not zero the pages they free
(``connect``): a spool written before the payload log holds envelopes in its rows,
and with zeroing a receipt wrote such a payload again.

Durability: WAL with synchronous=NORMAL and unsynced appends to the payload log, so
a committed sample survives a crash of the agent process; a power cut may lose the
last commits (FULL would fsync each one, too slow for SD cards), and a row whose
payload it lost is dropped when read (counted ``lost``).

Thread-safe: one connection guarded by a lock (SQLite writes serialise anyway).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_agent.payload_log import SEGMENT_BYTES, PayloadLog, Placement, SegmentChanges
from shared.errors import StoreError

log = logging.getLogger(__name__)

__all__ = [
    "PAGE_SIZE",
    "NewSample",
    "Spool",
    "SpoolStats",
    "SpooledSample",
    "WriteResult",
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
    payload BLOB NOT NULL,
    segment INTEGER,
    at INTEGER,
    crc INTEGER
);
CREATE INDEX IF NOT EXISTS samples_due ON samples (sent_at, priority, seq);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# Where a payload lives in the payload log (``edge_agent.payload_log``); a row without
# a segment holds its payload itself (written by an agent before the log existed).
_PLACEMENT_COLUMNS = ("segment", "at", "crc")


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
    lost: int = 0  # committed, but its payload was missing or damaged when read (power cut)


class Spool:
    """``Spool(path, max_bytes=..., max_samples=...)``; ``close()`` when done.

    The rows live in the SQLite file at ``path``, the payloads in the segment files of
    ``payload_folder`` beside it (``<stem>-payloads``, ``segment_bytes`` each at most).
    ``page_size`` applies to a new file only (an existing one keeps its pages).
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 256 << 20,
        max_samples: int = 100_000,
        page_size: int = PAGE_SIZE,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self.payload_folder = self.path.with_name(f"{self.path.stem}-payloads")
        self._payloads = PayloadLog(self.payload_folder, segment_bytes=segment_bytes)
        try:
            # Only a new file takes the page size (see the module docstring); an existing
            # spool keeps its own.
            self._db = connect(self.path, page_size=page_size)
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(samples)")}
            for column in _PLACEMENT_COLUMNS:
                if column not in columns:  # a spool from before the payload log
                    self._db.execute(f"ALTER TABLE samples ADD COLUMN {column} INTEGER")
            self._payloads.open(
                self._db.execute(
                    "SELECT segment, COUNT(*), SUM(size) FROM samples"
                    " WHERE segment IS NOT NULL GROUP BY segment"
                )
            )
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the spool at {self.path}: {exc}") from exc
        self._bytes, self._depth = self._db.execute(
            "SELECT COALESCE(SUM(size), 0), COUNT(*) FROM samples"
        ).fetchone()

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._payloads.close()

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
        changes = SegmentChanges()
        with self._lock:
            depth, total = self._depth, self._bytes
            fitting = [sample for sample in samples if len(sample.payload) <= self.max_bytes]
            payloads = self._payloads
            try:
                # Payloads first, in one system call; the rows that point at them commit
                # after (a crash in between leaves bytes no row refers to).
                compact = payloads.rotate_for(sum(len(sample.payload) for sample in fitting))
                appended_from = payloads.end
                places = iter(payloads.append([sample.payload for sample in fitting]))
            except OSError as exc:
                raise StoreError(f"spool write failed: {exc}") from exc
            try:
                self._db.execute("BEGIN IMMEDIATE")
                if compact is not None:
                    lost, lost_bytes = self._compact(compact, changes)
                    depth, total = depth - lost, total - lost_bytes
                    counts["lost"] = lost
                for sample in samples:
                    size = len(sample.payload)
                    if size > self.max_bytes:
                        counts["refused"] += 1
                        stored.append(False)
                        continue
                    place = next(places)
                    depth, total = self._make_room(size, depth, total, counts, changes)
                    cursor = self._db.execute(
                        "INSERT OR IGNORE INTO samples (sample_id, created_at, priority, audit,"
                        " size, sent_at, attempts, payload, segment, at, crc)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, x'', ?, ?, ?)",
                        (
                            sample.sample_id,
                            now,
                            sample.priority,
                            int(sample.audit),
                            size,
                            sent_at,
                            attempts,
                            place.segment,
                            place.offset,
                            place.crc,
                        ),
                    )
                    if cursor.rowcount == 1:  # 0: the id is already spooled
                        counts["stored"] += 1
                        depth += 1
                        total += size
                        changes.add(place.segment, size)
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
                    rows = self._db.execute(
                        "SELECT segment, COUNT(*), SUM(size) FROM samples"
                        f" WHERE sample_id IN ({marks}) GROUP BY segment",
                        chunk,
                    ).fetchall()
                    if rows:
                        self._db.execute(f"DELETE FROM samples WHERE sample_id IN ({marks})", chunk)
                    for segment, count, size in rows:
                        removed += int(count)
                        freed += int(size)
                        if segment is not None:
                            changes.remove(segment, int(size), int(count))
                if acked_ids:
                    counts["acked"] = removed
                for name, by in counts.items():
                    if by or name == "acked":
                        self._bump(name, by)
                self._db.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:  # OSError: compacting ran out of disk
                self._rollback()
                payloads.undo(appended_from)
                raise StoreError(f"spool write failed: {exc}") from exc
            payloads.commit(changes)
            self._depth, self._bytes = depth - removed, total - freed
        return WriteResult(stored, removed)

    def _make_room(
        self, size: int, depth: int, total: int, counts: dict[str, int], changes: SegmentChanges
    ) -> tuple[int, int]:
        while depth and (total + size > self.max_bytes or depth + 1 > self.max_samples):
            row = self._db.execute(
                "SELECT seq, size, audit, segment FROM samples ORDER BY audit DESC, seq ASC LIMIT 1"
            ).fetchone()
            if row is None:
                break
            self._db.execute("DELETE FROM samples WHERE seq = ?", (row[0],))
            counts["evicted_audit" if row[2] else "evicted_oldest"] += 1
            if row[3] is not None:
                changes.remove(row[3], row[1])
            total -= row[1]
            depth -= 1
        return depth, total

    def _compact(self, segment: int, changes: SegmentChanges) -> tuple[int, int]:
        """Move the payloads still in ``segment`` to the current one (its other bytes
        are receipted samples), so the old file can go; inside the caller's transaction.
        Rows whose payload cannot be read are deleted: (how many, their bytes)."""
        rows = self._db.execute(
            "SELECT seq, size, at, crc FROM samples WHERE segment = ? ORDER BY seq", (segment,)
        ).fetchall()
        payloads = self._payloads
        moving = [
            (seq, payloads.read(Placement(segment, at, size, crc))) for seq, size, at, crc in rows
        ]
        kept = [(seq, payload) for seq, payload in moving if payload is not None]
        places = payloads.append([payload for _, payload in kept])
        self._db.executemany(
            "UPDATE samples SET segment = ?, at = ? WHERE seq = ?",
            [
                (place.segment, place.offset, seq)
                for (seq, _), place in zip(kept, places, strict=True)
            ],
        )
        for place in places:
            changes.add(place.segment, place.size)
        changes.remove(segment, sum(size for _, size, _, _ in rows), len(rows))
        lost = [seq for seq, payload in moving if payload is None]
        self._db.executemany("DELETE FROM samples WHERE seq = ?", [(seq,) for seq in lost])
        size_of = {seq: size for seq, size, _, _ in rows}
        return len(lost), sum(size_of[seq] for seq in lost)

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
        """Samples to (re)publish: never sent, or sent over ``resend_after_s`` ago; urgent first.

        A sample whose payload is missing or damaged (a power cut before it reached
        the disk) is deleted and counted as ``lost`` instead."""
        due: list[SpooledSample] = []
        lost: list[tuple[int, int, int | None]] = []
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, sample_id, payload, priority, attempts, size, segment, at, crc"
                " FROM samples WHERE sent_at IS NULL OR sent_at <= ?"
                " ORDER BY priority, seq LIMIT ?",
                (now - resend_after_s, limit),
            ).fetchall()
            for seq, sample_id, inline, priority, attempts, size, segment, at, crc in rows:
                if segment is None:
                    payload: bytes | None = bytes(inline)
                else:
                    payload = self._payloads.read(Placement(segment, at, size, crc))
                if payload is None:
                    lost.append((seq, size, segment))
                else:
                    due.append(SpooledSample(sample_id, payload, priority, attempts))
            if lost:
                self._forget(lost)
        return due

    def _forget(self, lost: list[tuple[int, int, int | None]]) -> None:
        """Delete rows whose payload is gone (seq, size, segment); counted as ``lost``."""
        changes = SegmentChanges()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM samples WHERE seq = ?", [(r[0],) for r in lost])
            self._bump("lost", len(lost))
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"spool write failed: {exc}") from exc
        for _, size, segment in lost:
            if segment is not None:
                changes.remove(segment, size)
        self._payloads.commit(changes)
        log.warning("dropped %d spooled samples whose payloads were lost", len(lost))
        self._depth -= len(lost)
        self._bytes -= sum(size for _, size, _ in lost)

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
                lost=self._counter("lost"),
            )


def _chunks(ids: list[str], size: int = 500) -> Iterable[list[str]]:
    """Slices of ``ids`` small enough for SQLite's limit on bound parameters."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]
