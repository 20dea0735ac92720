"""The verifier process: MQTT ingest, storage, teacher batches, verdicts, receipts.

``VerifierWorker`` puts four parts together, each with its own threads
(``shared.lifecycle.Workers``):

    transport  (cloud_service.verifier_transport) the broker: one MQTT connection
               (thread verifier-mqtt-io), manual acks, the bounded inbox and its
               back-pressure
    ingest     (cloud_service.verifier_ingest) inbox -> classified batches on the
               decoder pool -> blobs + one transaction -> ack -> receipts
               (threads verifier-ingest, verifier-store, decode-N)
    verdicts   (cloud_service.verdicts) the teacher on same-shape batches
               (teacher-N) -> verdict rows -> verdicts published (verifier-verdicts)
    recovery   (cloud_service.verifier_recovery) stored samples still "pending" (a
               crash, a shed or failed batch) -> the teacher (verifier-recovery);
               with the per-agent breaker and dead letters' log on ingest's way

A message is acknowledged to the broker only after its blob is written and its row
committed; a sample redelivered after a crash is stored once and gets at most one
verdict row. ``stop`` takes no more messages, stores what is in hand, lets the
teacher finish and publishes its verdicts, then disconnects.
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.batcher import DynamicBatcher
from cloud_service.blobs import BlobStore, LocalBlobStore, open_blob_store
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.ingest import AgentBreaker, InboxBudget, ReceiptBuffer, SampleTask
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.verdicts import VerdictStage, batcher_config
from cloud_service.verifier import TeacherModel, TeacherScore
from cloud_service.verifier_ingest import IngestStage
from cloud_service.verifier_recovery import MalformedGuard, Recovery
from cloud_service.verifier_transport import VerifierTransport
from shared.decode_pool import DecodePool
from shared.interpreter import switch_interval, young_collections
from shared.mqtt import ProtocolName

__all__ = ["VerifierWorker", "batcher_config"]


class VerifierWorker:
    """Ingest and verify until stopped; ``with VerifierWorker(settings) as worker: ...``."""

    def __init__(
        self,
        settings: CloudSettings,
        *,
        teacher: TeacherModel | None = None,
        blobs: BlobStore | None = None,
        metrics: CloudMetrics | None = None,
        session_factory: sessionmaker[Session] | None = None,
        migrate: bool = True,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.metrics = metrics or CloudMetrics()
        if session_factory is None:
            url = settings.resolved_database_url
            if migrate:
                upgrade_database(url)
            # No ping before each checkout (a round trip per transaction, on the hot
            # path): every write retries (ingest.with_retries), and the first error
            # from a dead connection invalidates the pool, so the retry reconnects.
            self._engine: Engine | None = make_engine(url, pool_pre_ping=False)
            session_factory = make_session_factory(self._engine)
        else:
            self._engine = None
        self.sessions = session_factory
        self.blobs = blobs or open_blob_store(settings)
        self.teacher = teacher or TeacherModel(
            settings.resolved_teacher_model,
            name=settings.teacher_name,
            version=settings.teacher_version,
            providers=settings.ort_providers,
            intra_op_threads=settings.ort_intra_op_threads,
            allow_spinning=settings.ort_allow_spinning,
            gpu_kernels=settings.teacher_gpu_kernels,
        )
        self.counts = {
            "stored": 0,
            "duplicates": 0,
            "dead_letters": 0,
            "verdicts": 0,
            "images_discarded": 0,  # images of samples not stored (redelivered), deleted
        }
        # Progressive and costly images decode in processes, each within a budget: a
        # bomb is dead-lettered when its budget runs out, and its process killed.
        self.decode_pool = DecodePool(
            settings.decode_workers,
            budget_s=settings.decode_budget_ms / 1000,
            isolate_cost=settings.decode_isolate_cost,
            max_result_bytes=3 * settings.max_pixels,
            preload=("cloud_service.verifier",),
            name="verifier-decode",
        )
        self.transport = VerifierTransport(settings, self.metrics)
        self.verdicts = VerdictStage(
            settings,
            teacher=self.teacher,
            sessions=self.sessions,
            metrics=self.metrics,
            counts=self.counts,
            publish=self.transport.publish,
        )
        self.guard = MalformedGuard(
            settings,
            topics=self.topics,
            metrics=self.metrics,
            max_payload=self.transport.max_payload,
        )
        self.ingest = IngestStage(
            settings,
            transport=self.transport,
            sessions=self.sessions,
            blobs=self.blobs,
            metrics=self.metrics,
            counts=self.counts,
            guard=self.guard,
            verdicts=self.verdicts,
            decode_pool=self.decode_pool,
        )
        self.recovery = Recovery(
            settings,
            sessions=self.sessions,
            blobs=self.blobs,
            decode_pool=self.decode_pool,
            verdicts=self.verdicts,
            metrics=self.metrics,
        )
        self._switch_interval = switch_interval(settings.verifier_switch_interval_ms)
        self._collections = young_collections(settings.verifier_gc_young_every)
        self._stopped = False
        self._stop_lock = threading.Lock()

    # --- what the API, the UI and the tests read -------------------------------

    @property
    def ready(self) -> bool:
        return self.transport.ready

    @property
    def protocol(self) -> ProtocolName:
        return self.transport.protocol

    @property
    def inbox(self) -> InboxBudget:
        return self.transport.budget

    @property
    def batcher(self) -> DynamicBatcher[SampleTask, TeacherScore]:
        return self.verdicts.batcher

    @property
    def receipts(self) -> ReceiptBuffer:
        return self.ingest.receipts

    @property
    def breaker(self) -> AgentBreaker:
        return self.guard.breaker

    @property
    def shed_count(self) -> int:
        return self.verdicts.shed_count

    def subscriptions(self) -> list[str]:
        """The topic filters subscribed (shared ones on MQTT v5)."""
        return self.transport.filters()

    def recover_pending(self, *, limit: int = 100_000, grace_s: float = 0.0) -> int:
        """Submit stored, unverified samples that are not in flight here; return how many."""
        return self.recovery.recover_pending(limit=limit, grace_s=grace_s)

    def health(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "mqtt": self.transport.connection.health(),
            "teacher": self.verdicts.batcher.health(),
            "threads": {
                name: worker.alive
                for part in (self.ingest, self.verdicts, self.recovery)
                for name, worker in part.workers.health().items()
            },
            "counts": dict(self.counts),
        }

    # --- lifecycle -----------------------------------------------------------

    def __enter__(self) -> VerifierWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, connect_timeout: float = 15.0) -> None:
        """Start every part; TransportError (all stopped again) unless the broker takes
        the subscriptions within ``connect_timeout`` seconds."""
        # The MQTT thread releases the GIL on every socket read and must win it back from
        # threads that decode, store and score; at CPython's default interval it could
        # take in only a few hundred messages a second.
        self._switch_interval.apply()
        # Hundreds of short-lived objects per sample, hardly any cyclic: collected rarely,
        # and what the verifier holds once started (teacher, engine, pools) frozen.
        self._collections.apply()
        self.verdicts.start()
        self.ingest.start()
        self.recovery.start()
        try:
            self.transport.start(connect_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop taking messages, finish what is in hand, flush receipts, disconnect."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        # First, so the MQTT thread waiting for room in a full inbox returns (its message
        # unacked: the broker redelivers it) and nothing new is taken in. Unsubscribing
        # is not needed: the session keeps the subscriptions, and a restarted verifier
        # with the same client id receives what queued meanwhile.
        self.transport.mute()
        for part in (self.ingest, self.verdicts, self.recovery):
            part.workers.stopping.set()
        self.ingest.stop()  # stores what is staged, flushes the receipts
        self.verdicts.stop()  # the teacher runs what it holds; its verdicts go out
        self.recovery.stop()
        if isinstance(self.blobs, LocalBlobStore):
            self.blobs.close()  # its writer's lock: what it left unsettled is now sweepable
        self.decode_pool.close()
        self.transport.stop()
        if self._engine is not None:
            self._engine.dispose()
        self._switch_interval.restore()
        self._collections.restore()
