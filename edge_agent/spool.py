"""The disk spool in front of MQTT: a forwarded sample lives here until its receipt.

SQLite in WAL mode, one row per sample (the whole envelope as a blob). A sample is
deleted only by ``ack`` (the cloud's receipt for its id), never by a broker PUBACK;
``due`` hands out samples never sent or sent longer ago than the resend timeout,
and ``reset_sent`` makes everything due again after a reconnect. Bounded by bytes
and by count: to make room, audit samples go first (oldest first), then the oldest
of the rest; each eviction is counted by kind.

Thread-safe: one connection guarded by a lock (SQLite writes serialise anyway, and
the spool sees tens of writes per second, not thousands).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shared.errors import StoreError

__all__ = ["Spool", "SpoolStats", "SpooledSample"]

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


@dataclass(frozen=True)
class SpooledSample:
    sample_id: str
    payload: bytes
    priority: int
    attempts: int


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
    """``Spool(path, max_bytes=..., max_samples=...)``; ``close()`` when done."""

    def __init__(
        self, path: Path, *, max_bytes: int = 256 << 20, max_samples: int = 100_000
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_samples = max_samples
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                str(self.path), check_same_thread=False, isolation_level=None
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives a process crash (power loss may lose the last
            # commits); FULL would fsync on every sample, too slow for SD cards.
            self._db.execute("PRAGMA synchronous=NORMAL")
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
        size = len(payload)
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                if size > self.max_bytes:
                    self._bump("refused")
                    self._db.execute("COMMIT")
                    return False
                self._make_room(size)
                cursor = self._db.execute(
                    "INSERT OR IGNORE INTO samples (sample_id, created_at, priority, audit, size,"
                    " payload) VALUES (?, ?, ?, ?, ?, ?)",
                    (sample_id, now, priority, int(audit), size, payload),
                )
                inserted = cursor.rowcount == 1  # 0: the id is already spooled
                if inserted:
                    self._bump("stored")
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise StoreError(f"spool write failed: {exc}") from exc
            if inserted:
                self._bytes += size
                self._depth += 1
            return True

    def _make_room(self, size: int) -> None:
        while self._depth and (
            self._bytes + size > self.max_bytes or self._depth + 1 > self.max_samples
        ):
            row = self._db.execute(
                "SELECT seq, size, audit FROM samples ORDER BY audit DESC, seq ASC LIMIT 1"
            ).fetchone()
            if row is None:
                break
            self._db.execute("DELETE FROM samples WHERE seq = ?", (row[0],))
            self._bump("evicted_audit" if row[2] else "evicted_oldest")
            self._bytes -= row[1]
            self._depth -= 1

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")

    def ack(self, sample_ids: Iterable[str]) -> int:
        """Delete receipted samples; returns how many were still here."""
        ids = list(sample_ids)
        if not ids:
            return 0
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                marks = ",".join("?" * len(ids))
                row = self._db.execute(
                    "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM samples"
                    f" WHERE sample_id IN ({marks})",
                    ids,
                ).fetchone()
                self._db.execute(f"DELETE FROM samples WHERE sample_id IN ({marks})", ids)
                self._bump("acked", row[0])
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise StoreError(f"spool delete failed: {exc}") from exc
            self._depth -= row[0]
            self._bytes -= row[1]
            return int(row[0])

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
        ids = list(sample_ids)
        if not ids:
            return
        with self._lock:
            self._db.executemany(
                "UPDATE samples SET sent_at = ?, attempts = attempts + 1 WHERE sample_id = ?",
                [(now, sid) for sid in ids],
            )

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
