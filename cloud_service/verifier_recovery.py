"""What the verifier does about failures: samples left unverified, and malformed traffic.

``Recovery`` (thread ``verifier-recovery``) finds stored samples without a verdict
and queues them for the teacher: all of them at start (this verifier may have
crashed with them in flight), then every 30 s those older than
``recovery_grace_s`` (recent ones belong to whichever verifier of the shared
subscription holds them now). Shed or refused samples come back this way too.
Each scan also sweeps the images a dead verifier process wrote but never committed
rows for (``BlobStore.sweep_abandoned``): what no row points at is deleted.

``MalformedGuard`` wraps ingest's ``classify``: a message over every size limit is
dead-lettered unread, and a per-agent breaker (``cloud_service.ingest.AgentBreaker``)
isolates the bad messages on an agent's topics, not the agent. It mirrors the
breaker into ``agents.state`` and logs dead letters at most once per reason and
interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.blobs import BlobStore, SweptBlobs
from cloud_service.db import crud
from cloud_service.db.models import Agent
from cloud_service.ingest import AgentBreaker, Classified, DeadLetterRow, SampleTask
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.verdicts import VerdictStage
from cloud_service.verifier import decode_image
from shared.decode_pool import DecodePool
from shared.errors import EdgeLoopError
from shared.lifecycle import Workers
from shared.topics import TopicRef, Topics

__all__ = ["MalformedGuard", "Recovery"]

log = logging.getLogger(__name__)

_SCAN_EVERY_S = 30.0

Classify = Callable[[str, bytes], Classified]
GuardedClassify = Callable[[str, bytes, int], Classified]


class _LogLimiter:
    """At most one line per key every ``every_s`` seconds; the rest counted into the next."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def allow(self, key: str) -> int | None:
        """None to stay quiet, else how many lines of ``key`` were held back before this."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._skipped[key] += 1
            return None
        self._last[key] = now
        return self._skipped.pop(key, 0)


class MalformedGuard:
    """The size limit and the per-agent breaker around ``classify``; dead letters' log."""

    def __init__(
        self, settings: CloudSettings, *, topics: Topics, metrics: CloudMetrics, max_payload: int
    ) -> None:
        self.topics = topics
        self.metrics = metrics
        self.max_payload = max_payload
        self.breaker = AgentBreaker(
            window_s=settings.breaker_window_s,
            min_messages=settings.breaker_min_messages,
            error_rate=settings.breaker_error_rate,
            cooldown_s=settings.breaker_cooldown_s,
        )
        self._lock = threading.Lock()  # classify runs on the decoder pool
        self._isolated_shown: set[tuple[str, str]] = set()
        self._dead_letter_log = _LogLimiter(settings.breaker_log_every_s)

    def guard(self, classify: Classify) -> GuardedClassify:
        """``classify(topic, payload)`` as ``(topic, payload, size)``, behind both guards."""
        return self._breaker_guard(self._size_guard(classify))

    def _size_guard(self, inner: Classify) -> GuardedClassify:
        """``inner``, but a message over every limit is dead-lettered without its bytes."""

        def guarded(topic: str, payload: bytes, size: int) -> Classified:
            if size <= self.max_payload:
                return inner(topic, payload)
            try:
                ref: TopicRef | None = self.topics.parse(topic)
            except EdgeLoopError:
                ref = None
            return DeadLetterRow(
                topic=topic,
                reason="too_large",
                message=f"message of {size} bytes is over the largest the cloud takes"
                f" ({self.max_payload})",
                payload=b"",
                payload_size=size,
                fleet=ref.fleet if ref else None,
                agent_id=ref.agent if ref else None,
            )

        return guarded

    def _breaker_guard(self, inner: GuardedClassify) -> GuardedClassify:
        """``inner`` behind the per-agent breaker, which isolates bad messages, not the agent.

        Anyone who can publish on an agent's topic can trip its breaker, so an open one
        never refuses a well-formed message: every message is still classified, and
        what is taken is taken. While it is open, what is refused is dead-lettered as
        ``isolated`` without its bytes, and logged at most once per interval.
        """

        def guarded(topic: str, payload: bytes, size: int) -> Classified:
            try:
                ref = self.topics.parse(topic)
            except EdgeLoopError:
                return inner(topic, payload, size)  # no agent to blame: wrong_topic
            if ref.agent is None:
                return inner(topic, payload, size)
            with self._lock:
                until = self.breaker.isolated_until(ref.fleet, ref.agent)
            outcome = inner(topic, payload, size)
            refused = isinstance(outcome, DeadLetterRow)
            if until is not None:
                if not isinstance(outcome, DeadLetterRow):
                    return outcome
                return replace(
                    outcome,
                    reason="isolated",
                    message=f"refused ({outcome.reason}) while the breaker of"
                    f" {ref.fleet}/{ref.agent} is open: {outcome.message}",
                    payload=b"",
                )
            with self._lock:
                opened = self.breaker.record(ref.fleet, ref.agent, ok=not refused)
            if opened:
                self.metrics.isolations.labels(ref.fleet, ref.agent).inc()
                log.warning(
                    "agent %s/%s isolated: most messages on its topics are malformed; its"
                    " well-formed ones are still taken",
                    ref.fleet,
                    ref.agent,
                )
            return outcome

        return guarded

    def record_isolations(self, sessions: sessionmaker[Session]) -> None:
        """Mirror the breaker into agents.state ('isolated'), so the API shows it."""
        with self._lock:
            now_isolated = set(self.breaker.isolated())
        opened = now_isolated - self._isolated_shown
        closed = self._isolated_shown - now_isolated
        if not opened and not closed:
            return
        changes = [(key, "isolated") for key in opened] + [(key, "unknown") for key in closed]
        with sessions.begin() as session:
            for (fleet, agent), state in changes:
                session.execute(
                    update(Agent)
                    .where(Agent.agent_id == agent, Agent.fleet == fleet)
                    .values(state=state)
                )
        self._isolated_shown = now_isolated
        self.metrics.isolated_agents.set(len(now_isolated))

    def log_dead_letters(self, dead: list[DeadLetterRow]) -> None:
        """Count each dead letter; log one line per reason and interval, not per letter."""
        for letter in dead:
            self.metrics.dead_letters.labels(letter.reason).inc()
            # A flood of junk must not become a flood of log lines: one per reason and
            # interval, saying how many were held back.
            held_back = self._dead_letter_log.allow(letter.reason)
            if held_back is not None:
                log.info(
                    "dead letter on %s: %s (%s)%s",
                    letter.topic,
                    letter.reason,
                    letter.message,
                    f"; {held_back} more of this reason not logged" if held_back else "",
                )


class Recovery:
    """Queue stored, unverified samples for the teacher: at start, then every 30 s."""

    def __init__(
        self,
        settings: CloudSettings,
        *,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        decode_pool: DecodePool,
        verdicts: VerdictStage,
        metrics: CloudMetrics,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.blobs = blobs
        self.decode_pool = decode_pool
        self.verdicts = verdicts
        self.metrics = metrics
        self.workers = Workers("verifier")
        self._grace_s = 0.0  # the first scan takes every pending sample

    def start(self) -> None:
        self.workers.spawn("recovery", self._scan, every=_SCAN_EVERY_S)

    def stop(self, timeout: float = 10.0) -> None:
        self.workers.stop(timeout)

    def _scan(self) -> None:
        try:
            self.recover_pending(grace_s=self._grace_s)
            self._grace_s = self.settings.recovery_grace_s
        except (SQLAlchemyError, EdgeLoopError, OSError) as exc:
            log.warning("recovery scan failed: %s", exc)
        try:
            self.sweep_abandoned_images()
        except (SQLAlchemyError, EdgeLoopError) as exc:
            log.warning("sweeping abandoned images failed: %s", exc)

    def sweep_abandoned_images(self, *, older_than_s: float | None = None) -> SweptBlobs:
        """Delete the images that dead verifier processes wrote and no row points at.

        Only batches marked at least ``older_than_s`` ago (default ``recovery_grace_s``)
        are looked at: a commit the database had not finished when its process died
        has long landed or been rolled back by then.
        """

        def referenced(prefix: str) -> list[str]:
            with self.sessions() as session:
                return crud.image_keys_under(session=session, prefix=prefix)

        grace = self.settings.recovery_grace_s if older_than_s is None else older_than_s
        swept = self.blobs.sweep_abandoned(referenced, older_than_s=grace)
        if swept.batches:
            self.metrics.abandoned_batches.inc(swept.batches)
            log.warning(
                "swept %d image batch(es) a dead verifier left unsettled: %d bytes no"
                " sample pointed at deleted, %d kept",
                swept.batches,
                swept.bytes_deleted,
                swept.bytes_kept,
            )
        return swept

    def recover_pending(self, *, limit: int = 100_000, grace_s: float = 0.0) -> int:
        """Submit stored, unverified samples that are not in flight here; return how many.

        Samples stored in the last ``grace_s`` seconds are left alone.
        """
        count = 0
        after = ""
        received_before = datetime.now(UTC) - timedelta(seconds=grace_s) if grace_s else None
        stopping = self.workers.stopping
        size = self.verdicts.teacher.input_size
        while count < limit and not stopping.is_set():
            with self.sessions() as session:
                rows = crud.pending_samples(
                    session=session, limit=500, after=after, received_before=received_before
                )
            if not rows:
                break
            after = rows[-1].sample_id
            for row in rows:
                if self.verdicts.in_flight(row.sample_id):
                    continue
                try:
                    image = self.blobs.get(row.image_key)
                    pixels = decode_image(image, size, pool=self.decode_pool)
                except EdgeLoopError as exc:
                    log.error("cannot recover sample %s: %s", row.sample_id, exc)
                    continue
                self.verdicts.submit(
                    SampleTask(
                        sample_id=row.sample_id,
                        fleet=row.fleet,
                        agent=row.agent_id,
                        captured_at=row.captured_at,
                        edge=self.verdicts.task.sample_answer(
                            SimpleNamespace(
                                predicted=row.edge_predicted,
                                confidence=row.edge_confidence,
                                scores=row.edge_scores,
                                boxes=row.edge_boxes,
                            )
                        ),
                        priority=row.priority,
                        pixels=pixels,
                        edge_sample_id=(
                            row.edge_sample_id if row.edge_sample_id != row.sample_id else None
                        ),
                    )
                )
                count += 1
        if count:
            log.info("recovery: %d stored samples queued for the teacher", count)
        return count
