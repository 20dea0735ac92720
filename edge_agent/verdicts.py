"""Verdicts on the edge: the answers kept in memory, the verdict store, the user's webhook.

A verdict from the cloud is matched to the edge's answer for its sample (the newest
``results_kept`` answers are held in memory), stored in its own SQLite file
(:class:`VerdictStore`, the newest ``verdicts_kept``) so ``GET /v1/samples/{id}``
still shows it after a restart, and posted to the user's application when a
``webhook_url`` is set (``webhook-loop``: a bounded queue, retries with jittered
backoff; inference never waits for it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import queue
import random
import sqlite3
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from edge_agent.settings import AgentSettings
from edge_agent.spool import connect
from edge_agent.telemetry import Telemetry
from edge_agent.uplink import Backoff
from shared.errors import StoreError
from shared.lifecycle import Workers
from shared.messages import Verdict

__all__ = ["RecentAnswers", "VerdictKeeper", "VerdictStore", "WebhookPoster"]

log = logging.getLogger(__name__)


class VerdictStore:
    """Verdicts by sample id in their own SQLite file (4 KiB pages), newest kept.

    The edge's answer is stored beside a verdict when the agent still holds it. The
    file is not the spool's: a verdict is a few hundred bytes, and in the spool's
    larger pages each one rewrote far more than itself. ``put`` only queues a verdict
    (readable at once through ``get``); a writer thread stores what gathered within
    ``window_s`` in one transaction, as the cloud sends verdicts in bursts (one per
    teacher batch): one commit for a burst instead of two per verdict (the insert and
    the trim to ``keep``). A crash loses at most the verdicts of that window; the
    agent still holds them in memory until then. ``moved_from``: a spool file that
    still holds a ``verdicts`` table (agents before the split); its rows move here
    once and the table is dropped there.
    """

    PAGE_SIZE = 4096

    def __init__(
        self, path: Path, *, keep: int, moved_from: Path | None = None, window_s: float = 0.05
    ) -> None:
        self.path = Path(path)
        self.keep = keep
        self.window_s = window_s
        self.commits = 0
        self.write_errors = 0
        self._lock = threading.Lock()  # the connection
        self._queue = threading.Condition()  # guards _pending and _writing
        # sample id -> (received_at, verdict JSON, result JSON or None), oldest first
        self._pending: dict[str, tuple[float, str, str | None]] = {}
        self._writing = False
        self._closed = False
        try:
            self._db = connect(self.path, page_size=self.PAGE_SIZE, timeout=10.0)
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS verdicts ("
                " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                " sample_id TEXT NOT NULL UNIQUE,"
                " received_at REAL NOT NULL,"
                " verdict TEXT NOT NULL,"
                " result TEXT)"
            )
            if moved_from is not None and Path(moved_from).exists():
                self._move_from(Path(moved_from))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the verdict store at {self.path}: {exc}") from exc
        self._workers = Workers("verdict")
        self._writer = self._workers.spawn("writer", self._run)

    def _move_from(self, old: Path) -> None:
        db = self._db
        db.execute("ATTACH DATABASE ? AS old", (str(old),))
        try:
            found = db.execute(
                "SELECT 1 FROM old.sqlite_master WHERE type = 'table' AND name = 'verdicts'"
            ).fetchone()
            if found is None:
                return
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT OR IGNORE INTO main.verdicts (sample_id, received_at, verdict, result)"
                    " SELECT sample_id, received_at, verdict, result FROM old.verdicts"
                    " ORDER BY seq"
                )
                db.execute("DROP TABLE old.verdicts")
                db.execute("COMMIT")
            except sqlite3.Error:
                db.execute("ROLLBACK")
                raise
            log.info("moved the verdicts kept in %s to %s", old, self.path)
        finally:
            db.execute("DETACH DATABASE old")

    def put(
        self, sample_id: str, verdict: dict[str, Any], result: dict[str, Any] | None, now: float
    ) -> None:
        """Queue (or replace) the verdict for ``sample_id``; the writer stores it shortly."""
        # orjson: a tenth of the json module's time, on the MQTT thread for every verdict.
        result_json = orjson.dumps(result).decode() if result is not None else None
        row = (now, orjson.dumps(verdict).decode(), result_json)
        with self._queue:
            if self._closed:
                raise StoreError(f"the verdict store is closed; {sample_id} not stored")
            earlier = self._pending.pop(sample_id, None)
            if earlier is not None and row[2] is None:
                row = (row[0], row[1], earlier[2])  # a known result stays
            self._pending[sample_id] = row
            if len(self._pending) == 1:
                self._queue.notify_all()

    def _run(self) -> None:
        while True:
            with self._queue:
                while not self._pending and not self._closed:
                    self._queue.wait()
                if not self._pending:
                    return
                if not self._closed:  # gather the rest of the burst
                    self._queue.wait(self.window_s)
                batch, self._pending = self._pending, {}
                self._writing = True
            try:
                self._write(batch)
            finally:
                with self._queue:
                    self._writing = False
                    self._queue.notify_all()

    def _write(self, batch: dict[str, tuple[float, str, str | None]]) -> None:
        rows = [(sample_id, *row) for sample_id, row in batch.items()]
        try:
            with self._lock:
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany(
                        "INSERT INTO verdicts (sample_id, received_at, verdict, result)"
                        " VALUES (?, ?, ?, ?) ON CONFLICT(sample_id) DO UPDATE SET"
                        " received_at = excluded.received_at, verdict = excluded.verdict,"
                        " result = COALESCE(excluded.result, result)",
                        rows,
                    )
                    newest = db.execute("SELECT MAX(seq) FROM verdicts").fetchone()[0] or 0
                    db.execute("DELETE FROM verdicts WHERE seq <= ?", (newest - self.keep,))
                    db.execute("COMMIT")
                    self.commits += 1
                except sqlite3.Error:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            # Still answered from memory; only a restart would lose them.
            self.write_errors += len(rows)
            log.warning("could not store %d verdicts: %s", len(rows), exc)

    def flush(self) -> None:
        """Return once every verdict queued so far is written (or failed)."""
        with self._queue:
            while (self._pending or self._writing) and self._writer.is_alive():
                self._queue.notify_all()
                self._queue.wait(0.05)

    def get(self, sample_id: str) -> dict[str, Any] | None:
        """``{"verdict": ..., "result": ...}`` (result when known) or None."""
        with self._queue:
            queued = self._pending.get(sample_id)
        if queued is not None:
            row: tuple[str, str | None] | None = (queued[1], queued[2])
        else:
            try:
                with self._lock:
                    row = self._db.execute(
                        "SELECT verdict, result FROM verdicts WHERE sample_id = ?", (sample_id,)
                    ).fetchone()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read the verdict for {sample_id}: {exc}") from exc
        if row is None:
            return None
        entry: dict[str, Any] = {"verdict": json.loads(row[0])}
        if row[1] is not None:
            entry["result"] = json.loads(row[1])
        return entry

    def count(self) -> int:
        """Verdicts stored (after writing what is queued)."""
        self.flush()
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def health(self) -> dict[str, object]:
        """The writer thread's state."""
        return dict(self._workers.health())

    def close(self) -> None:
        """Write what is queued, then close the file."""
        with self._queue:
            self._closed = True
            self._queue.notify_all()
        self._workers.stop(10.0)
        with self._lock:
            self._db.close()


class RecentAnswers:
    """The newest ``keep`` answers by sample id, with their verdicts once they arrive."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def remember(self, answers: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Keep each ``(sample_id, answer)``; the oldest go past ``keep``."""
        with self._lock:
            for sample_id, answer in answers:
                self._entries.setdefault(sample_id, {})["result"] = answer
            while len(self._entries) > self.keep:
                self._entries.popitem(last=False)

    def add_verdict(self, sample_id: str, verdict: dict[str, Any]) -> dict[str, Any] | None:
        """Note the verdict for ``sample_id``; returns the answer it judges, when held."""
        with self._lock:
            entry = self._entries.setdefault(sample_id, {})
            entry["verdict"] = verdict
            result: dict[str, Any] | None = entry.get("result")
            return result

    def get(self, sample_id: str) -> dict[str, Any] | None:
        """A copy of what is held for ``sample_id`` (answer, verdict) or None."""
        with self._lock:
            entry = self._entries.get(sample_id)
            return dict(entry) if entry is not None else None


class WebhookPoster:
    """Posts verdicts to the user's application on ``webhook-loop`` (bounded queue, retries)."""

    def __init__(
        self, settings: AgentSettings, *, telemetry: Telemetry, rng: random.Random
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self._rng = rng
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(settings.webhook_queue)
        self._workers = Workers("webhook")

    @property
    def pending(self) -> int:
        """Verdicts waiting to be posted."""
        return self._queue.qsize()

    def offer(self, data: dict[str, Any]) -> None:
        """Queue a verdict to post; counted as dropped when the queue is full."""
        try:
            self._queue.put_nowait(data)
        except queue.Full:
            self.telemetry.webhook.labels("dropped").inc()
            log.warning("webhook queue full; verdict %s not posted", data.get("sample_id"))

    def start(self) -> WebhookPoster:
        self._workers.spawn("loop", self._run)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._workers.stop(timeout)

    def health(self) -> dict[str, object]:
        return dict(self._workers.health())

    def _run(self) -> None:
        import httpx

        s = self.settings
        url = s.webhook_url
        assert url is not None
        counts = self.telemetry.webhook
        stopping = self._workers.stopping
        with httpx.Client(timeout=s.webhook_timeout_s) as client:
            while not stopping.is_set():
                try:
                    data = self._queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                backoff = Backoff(s.webhook_backoff_min_s, s.webhook_backoff_max_s, self._rng)
                for attempt in range(1, s.webhook_attempts + 1):
                    try:
                        response = client.post(url, json=data)
                    except httpx.HTTPError as exc:
                        problem, permanent = f"{type(exc).__name__}: {exc}", False
                    else:
                        if response.is_success:
                            counts.labels("delivered").inc()
                            break
                        problem = f"HTTP {response.status_code}"
                        # A refusal (4xx) will not change on a retry; overload or timeout may.
                        permanent = response.is_client_error and response.status_code not in (
                            408,
                            429,
                        )
                    if permanent or attempt == s.webhook_attempts:
                        counts.labels("failed").inc()
                        log.warning(
                            "webhook %s: gave up on verdict %s after %d attempt(s): %s",
                            url,
                            data.get("sample_id"),
                            attempt,
                            problem,
                        )
                        break
                    counts.labels("retried").inc()
                    if stopping.wait(backoff.next_delay()):
                        break


class VerdictKeeper:
    """Where the cloud's verdicts go: matched to answers, stored, posted to the webhook."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        store: VerdictStore,
        telemetry: Telemetry,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.settings = settings
        self.store = store
        self.telemetry = telemetry
        self.clock = clock
        self.answers = RecentAnswers(settings.results_kept)
        self.webhook = WebhookPoster(settings, telemetry=telemetry, rng=rng)

    def start(self) -> VerdictKeeper:
        """Start posting verdicts, when a webhook is configured."""
        if self.settings.webhook_url:
            self.webhook.start()
        return self

    def stop(self) -> None:
        """Stop posting to the webhook (the store stays open until :meth:`close`)."""
        self.webhook.stop()

    def close(self) -> None:
        """Write the verdicts still queued and close the store."""
        self.store.close()

    def health(self) -> dict[str, object]:
        return {**self.webhook.health(), **self.store.health()}

    def on_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        """``on_verdict`` for each of a message's verdicts."""
        for verdict in verdicts:
            self.on_verdict(verdict)

    def on_verdict(self, verdict: Verdict) -> None:
        """Count, match, store and post one verdict (a store failure is logged)."""
        self.telemetry.record_verdict(verdict.agrees_with_edge)
        data = verdict.model_dump(mode="json", by_alias=True)
        result = self.answers.add_verdict(verdict.sample_id, data)
        try:
            self.store.put(verdict.sample_id, data, result, now=self.clock())
        except StoreError as exc:  # still answered from memory; only a restart would lose it
            log.warning("%s", exc)
        if self.settings.webhook_url:
            self.webhook.offer(data)

    def sample(self, sample_id: str) -> dict[str, Any] | None:
        """The answer and (when it has arrived) the teacher's verdict for a sample id."""
        found = self.answers.get(sample_id)
        if found is not None and "verdict" in found:
            return found
        try:
            stored = self.store.get(sample_id)
        except StoreError as exc:
            log.warning("%s", exc)
            stored = None
        if stored is None:
            return found
        return {**stored, **(found or {})}
