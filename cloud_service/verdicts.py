"""The verifier's verdicts: stored samples -> teacher batches -> verdict rows -> verdicts out.

``VerdictStage`` owns the teacher's dynamic batcher (``cloud_service.batcher``,
threads ``teacher-N``) and the ``verifier-verdicts`` thread. A stored sample is
submitted once (the stage tracks what is in flight); under overload the lowest
priorities (audit samples first) are shed: stored, acked and receipted already,
they stay pending until the recovery scan queues them again. Each teacher batch's
results become verdict rows in one transaction per drain (a unique sample_id on
verdicts: at most one row per sample), and the new verdicts are published to their
agents with the ids the agents gave the samples, each agent's together in one
``edgeloop.verdicts`` message (``verdicts_per_message`` at most).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.batcher import (
    BatcherClosedError,
    BatcherConfig,
    BatchInfo,
    DynamicBatcher,
    QueueFullError,
)
from cloud_service.db import crud
from cloud_service.db.models import Sample
from cloud_service.ingest import SampleTask, drain, with_retries
from cloud_service.metrics import CloudMetrics
from cloud_service.review import ReviewRules
from cloud_service.settings import CloudSettings
from cloud_service.verifier import TeacherModel, TeacherScore
from shared.errors import StoreError
from shared.lifecycle import Workers
from shared.messages import Verdict, encode_verdicts
from shared.tasks import Answer, task_for

__all__ = ["VerdictStage", "batcher_config"]

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], None]
_Result = tuple[SampleTask, TeacherScore | BaseException]


def batcher_config(settings: CloudSettings) -> BatcherConfig:
    return BatcherConfig(
        max_batch_size=settings.max_batch_size,
        preferred_batch_sizes=tuple(
            s for s in settings.preferred_batch_sizes if s <= settings.max_batch_size
        ),
        max_queue_delay_s=settings.max_queue_delay_ms / 1000,
        priority_levels=settings.priority_levels,
        max_queue_size=settings.max_queue_size,
        queue_policy=settings.queue_policy,
        timeout_s=settings.queue_timeout_s,
        instances=settings.model_instances,
    )


class VerdictStage:
    """``submit``/``submit_many`` stored samples; verdicts are stored and published."""

    def __init__(
        self,
        settings: CloudSettings,
        *,
        teacher: TeacherModel,
        sessions: sessionmaker[Session],
        metrics: CloudMetrics,
        counts: dict[str, int],
        publish: Publish,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.teacher = teacher
        self.sessions = sessions
        self.metrics = metrics
        self.counts = counts
        self._publish = publish
        # What an answer is and how two compare: the teacher's task (shared.tasks).
        self.task = task_for(teacher.info.task)
        self.rules = ReviewRules(
            confidence_below=settings.review_confidence_below,
            on_disagreement=settings.review_on_disagreement,
            audit_share=settings.review_audit_share,
        )
        self.batcher: DynamicBatcher[SampleTask, TeacherScore] = DynamicBatcher(
            self._run_batch, batcher_config(settings), on_batch=self._on_batch, name="teacher"
        )
        # Each teacher batch's results as one item: (task, score or the batch's error).
        self._results: queue.Queue[list[_Result]] = queue.Queue()
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self.shed_count = 0
        self.workers = Workers("verifier")

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self.batcher.start()
        self.workers.spawn("verdicts", self._verdict_loop)

    def stop(self, timeout: float = 10.0) -> None:
        """Run what the teacher holds, store and publish its verdicts, then stop."""
        self.workers.stopping.set()
        self.batcher.close(drain=True)
        self.workers.stop(timeout)

    # --- submitting ------------------------------------------------------------

    def in_flight(self, sample_id: str) -> bool:
        """Whether ``sample_id`` is with the teacher now."""
        with self._inflight_lock:
            return sample_id in self._inflight

    def submit(self, task: SampleTask) -> None:
        if self._admit(task):
            self.batcher.queue_many([(task, *self._request(task))])

    def submit_many(self, tasks: list[SampleTask]) -> None:
        """Queue new samples for the teacher in one hand-off to the batcher."""
        admitted = [task for task in tasks if self._admit(task)]
        if not admitted:
            return
        try:
            self.batcher.queue_many([(task, *self._request(task)) for task in admitted])
        except (QueueFullError, BatcherClosedError) as exc:
            # Stored and acked already: left pending, the recovery scan queues them later.
            log.warning("teacher queue refused samples (%s); they stay pending", exc)
            with self._inflight_lock:
                self._inflight.difference_update(t.sample_id for t in admitted)

    def _admit(self, task: SampleTask) -> bool:
        """Whether ``task`` goes to the batcher now (marked in flight) or waits, pending."""
        if (
            task.priority >= self.settings.shed_priority_at_least
            and self.batcher.depth >= self.settings.shed_queue_depth
        ):
            # Shed under overload, lowest priority (audit) first: the sample is stored,
            # acked and receipted, just left pending; the recovery scan verifies it
            # once the queue has drained. Nothing stored is lost.
            self.metrics.shed.labels(str(task.priority)).inc()
            self.shed_count += 1
            return False
        with self._inflight_lock:
            if task.sample_id in self._inflight:
                return False
            self._inflight.add(task.sample_id)
        return True

    def _request(self, task: SampleTask) -> tuple[tuple[int, ...], int, float]:
        """The batcher's (shape, priority level, order) for ``task``."""
        # A sample's priority runs 0 (most urgent) .. 9, the batcher's levels the other
        # way (highest first), so invert. Least sure first within a level: those are
        # the likeliest mistakes. The batch's results reach the verdict thread from
        # _run_batch, all at once (no future per sample).
        level = self.batcher.config.priority_levels - 1 - task.priority
        return task.pixels.shape, level, task.edge.confidence

    # --- teacher -------------------------------------------------------------

    def _run_batch(self, tasks: Sequence[SampleTask]) -> list[TeacherScore]:
        """Score a batch and hand its results (or its error) to the verdict thread."""
        try:
            results = self.teacher.score_many([t.pixels for t in tasks])
        except BaseException as exc:
            self._results.put([(_without_pixels(task), exc) for task in tasks])
            raise
        # The verdict stage needs no pixels: its queue holds only small records.
        self._results.put([(_without_pixels(t), r) for t, r in zip(tasks, results, strict=True)])
        return results

    def _on_batch(self, info: BatchInfo) -> None:
        m = self.metrics
        m.batch_size.observe(info.size)
        m.compute.observe(info.compute_s)
        for delay in info.queue_delays_s:
            m.queue_delay.observe(delay)
        m.queue_depth.set(self.batcher.depth)

    # --- verdicts ------------------------------------------------------------

    def _verdict_loop(self) -> None:
        stopping = self.workers.stopping
        while True:
            # Stopped, and the teacher has run everything it held: drain, then return.
            done = stopping.is_set() and not self.batcher.running
            batch = self._take_results()
            if batch:
                with_retries(
                    functools.partial(self._store_verdicts, batch),
                    stopping=stopping,
                    on_failure=self.metrics.store_errors.inc,
                )
            elif done:
                return

    def _take_results(self) -> list[_Result]:
        """The teacher's results waiting now (after up to 50 ms for the first); under a
        backlog (a full batch or more queued for the teacher), with the next batch's too.

        With a backlog the next results come at the teacher's pace, so waiting for them
        costs a verdict at most one batch's time, and one transaction, one publish and
        one wake-up serve both batches (alternating verifier processes on this host:
        1.086 against 1.117 ms of CPU per sample, 6 rounds). Without one nothing waits.
        """
        batch = [item for results in drain(self._results, 16, 0.05) for item in results]
        if batch and self.batcher.depth >= self.batcher.config.max_batch_size:
            with contextlib.suppress(queue.Empty):
                batch += self._results.get(timeout=_BACKLOG_WAIT_S)
        return batch

    def _store_verdicts(self, results: list[_Result]) -> None:
        now = datetime.now(UTC)
        # (the id the sample is stored under, the verdict the agent gets with its own id)
        verdicts: list[tuple[str, Verdict]] = []
        for task, result in results:
            if isinstance(result, BaseException):
                log.error("teacher failed on %s: %s", task.sample_id, result)
                continue
            verdicts.append((task.sample_id, self._make_verdict(task, result, now)))
        latency = {task.sample_id: (now - task.captured_at).total_seconds() for task, _ in results}
        rows = [
            {
                "sample_id": cloud_id,
                "teacher_model": v.teacher_model,
                "teacher_version": v.teacher_version,
                "scores": list(v.scores),
                "label": v.label,
                "confidence": v.confidence,
                "boxes": v.boxes,
                "agrees_with_edge": v.agrees_with_edge,
                "review": v.review,
                "review_reasons": list(v.review_reasons),
                "verified_at": v.verified_at,
                "latency_s": latency[cloud_id],
            }
            for cloud_id, v in verdicts
        ]
        with self.sessions.begin() as session:
            new = crud.insert_verdicts(session=session, rows=rows) if rows else set()
            existing = [cloud_id for cloud_id, _ in verdicts if cloud_id not in new]
            stored = crud.get_verdicts(session=session, sample_ids=existing) if existing else []
            again = [self.verdict_from_row(v) for v in stored]
        with self._inflight_lock:
            for task, _ in results:
                self._inflight.discard(task.sample_id)
        m = self.metrics
        agreed = 0
        outcomes: Counter[tuple[str, str]] = Counter()
        out: list[Verdict] = []
        for cloud_id, verdict in verdicts:
            if cloud_id in new:
                out.append(verdict)
                agreed += verdict.agrees_with_edge
                outcomes[str(verdict.agrees_with_edge).lower(), str(verdict.review).lower()] += 1
                m.capture_to_verdict.observe(max(latency[cloud_id], 0.0))
        for (agrees, review), count in outcomes.items():
            m.verdicts.labels(agrees, review).inc(count)
        m.observe_verdicts(agreed, len(new))
        self.counts["verdicts"] += len(new)
        self.publish_many(out + again)

    def _make_verdict(self, task: SampleTask, result: TeacherScore, now: datetime) -> Verdict:
        teacher = result.answer or Answer(
            result.label, result.confidence, tuple(result.scores.tolist())
        )
        comparison = self.task.compare(task.edge, teacher)
        agrees = comparison.agrees
        confidence = min(max(result.confidence, 0.0), 1.0)
        reasons = self.rules.reasons(
            sample_id=task.sample_id, teacher_confidence=confidence, agrees_with_edge=agrees
        )
        if not agrees and "disagreement" in reasons:
            # What differs, for the reviewer (a detector's: missed, extra, wrong_class...).
            reasons += [d for d in comparison.differences if d not in reasons]
        info = self.teacher.info
        return Verdict(
            sample_id=task.agent_sample_id,
            fleet=task.fleet,
            agent=task.agent,
            teacher_model=info.name,
            teacher_version=info.version,
            **self.task.verdict_fields(teacher),
            agrees_with_edge=agrees,
            review=bool(reasons),
            review_reasons=reasons,
            verified_at=now,
        )

    def verdict_from_row(self, row: Any) -> Verdict:
        """The verdict message of a stored verdict row, addressed to its sample's agent."""
        sample_fleet, sample_agent, edge_sample_id = self._sample_source(row.sample_id)
        return Verdict(
            sample_id=edge_sample_id,
            fleet=sample_fleet,
            agent=sample_agent,
            teacher_model=row.teacher_model,
            teacher_version=row.teacher_version,
            scores=row.scores,
            label=row.label,
            confidence=row.confidence,
            boxes=row.boxes,
            agrees_with_edge=row.agrees_with_edge,
            review=row.review,
            review_reasons=row.review_reasons,
            verified_at=row.verified_at,
        )

    def _sample_source(self, sample_id: str) -> tuple[str, str, str]:
        """The stored sample's fleet, agent and the id its agent gave it."""
        with self.sessions() as session:
            sample = session.get(Sample, sample_id)
            if sample is None:  # the verdict's foreign key makes this unreachable
                raise StoreError(f"verdict for unknown sample {sample_id}")
            return sample.fleet, sample.agent_id, sample.edge_sample_id or sample.sample_id

    def publish_many(self, verdicts: Sequence[Verdict]) -> None:
        """Send ``verdicts`` to their agents, each agent's together (``edgeloop.verdicts``
        of at most ``verdicts_per_message``; one ``edgeloop.verdict`` each when 1)."""
        for fleet, agent, payload in encode_verdicts(
            verdicts, per_message=self.settings.verdicts_per_message
        ):
            self._publish(self.topics.verdicts(fleet, agent), payload)


def _without_pixels(task: SampleTask) -> SampleTask:
    return replace(task, pixels=_NO_PIXELS)


_NO_PIXELS = np.zeros((0,), np.uint8)
# Under a backlog, how long verdicts wait for the teacher's next batch to share their
# transaction (the bench's teacher runs a batch of 32 in about 5 ms with both cores).
_BACKLOG_WAIT_S = 0.05
