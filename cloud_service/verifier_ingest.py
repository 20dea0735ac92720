"""The verifier's ingest: inbox -> classified batches -> stored -> acked, receipted, queued.

``IngestStage`` runs two threads:

    verifier-ingest  inbox -> a batch of messages, classified (envelope checks, image
                     decode) in chunks on the decoder pool -> staged
    verifier-store   staged batches in order -> blobs (one flush) + one DB transaction
                     -> ack -> receipts, new samples -> the teacher; while it waits on
                     the disk and the database, the next batch is being decoded

A message is acknowledged to the broker only after its blob is written and its row
committed; a sample redelivered after a crash is stored once (ON CONFLICT DO NOTHING
on sample_id). Sample ids are unique per agent: a sample whose id another agent's
sample holds is stored under a derived cloud id (``crud.store_samples``) and
answered with its own.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime

from sqlalchemy.orm import Session, sessionmaker

from cloud_service.blobs import BlobBatch, BlobStore
from cloud_service.db import crud
from cloud_service.ingest import (
    Classified,
    DeadLetterRow,
    IngestModelStatus,
    IngestSample,
    IngestStatus,
    ReceiptBuffer,
    SampleTask,
    classify,
    drain,
    sample_row,
    with_retries,
)
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.verdicts import VerdictStage
from cloud_service.verifier_recovery import MalformedGuard
from cloud_service.verifier_transport import Inbound, VerifierTransport
from shared.decode_pool import DecodePool
from shared.errors import StoreError
from shared.lifecycle import Workers
from shared.messages import Receipt, encode_message

__all__ = ["IngestStage", "auto_decode_threads"]

log = logging.getLogger(__name__)

# A batch of messages and the futures of their classification, in chunks.
_Staged = tuple[list[Inbound], list[Future[list[Classified]]]]


def auto_decode_threads(cores: int) -> int:
    """Decode threads for a verifier process with ``cores`` cores to itself: one per
    core, at most 4. Several processes on one host split the host's cores between
    them (``service.worker_settings``): two processes on two cores decoding on a
    thread each took 0.943 against 0.965 ms of CPU per sample and verified 1595
    against 1521 samples/s (bench.ab verifier --workers 2, 10 rounds)."""
    return max(1, min(4, cores))


class IngestStage:
    """Classify, store, acknowledge and receipt what the transport's inbox holds."""

    def __init__(
        self,
        settings: CloudSettings,
        *,
        transport: VerifierTransport,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        metrics: CloudMetrics,
        counts: dict[str, int],
        guard: MalformedGuard,
        verdicts: VerdictStage,
        decode_pool: DecodePool,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.limits = settings.envelope_limits
        self.transport = transport
        self.sessions = sessions
        self.blobs = blobs
        self.metrics = metrics
        self.counts = counts
        self.guard = guard
        self.verdicts = verdicts
        self.decode_pool = decode_pool
        self.receipts = ReceiptBuffer(
            flush_s=settings.receipt_flush_ms / 1000, max_ids=settings.receipt_max_ids
        )
        # Image decode is ingest's largest cost and OpenCV releases the GIL while it
        # decodes and resizes, so a small pool spreads one ingest batch over the cores.
        self._decode_workers = settings.verifier_decode_threads or auto_decode_threads(
            os.cpu_count() or 1
        )
        self._decoders = ThreadPoolExecutor(
            max_workers=self._decode_workers, thread_name_prefix="decode"
        )
        # Writes a batch's images while its rows are inserted: the transaction commits
        # only once they are durable, so a row never points at a missing image.
        self._blob_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blobs")
        # Batches classified (or being classified) and waiting for the store thread, in
        # arrival order; two at most, so a slow store holds messages in the inbox, where
        # they form bigger batches, not here. None: the ingest thread stopped.
        self._staged: queue.Queue[_Staged | None] = queue.Queue(maxsize=2)
        self.workers = Workers("verifier")

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self.workers.spawn("ingest", self._ingest_loop)
        self.workers.spawn("store", self._store_loop)

    def stop(self, timeout: float = 20.0) -> None:
        """Store what is staged, flush every receipt, then stop the pools."""
        self.workers.stop(timeout)
        self._decoders.shutdown(wait=True)
        self._blob_writer.shutdown(wait=True)

    # --- the threads -----------------------------------------------------------

    def _ingest_loop(self) -> None:
        """Drain the inbox in batches and start classifying each on the decoder pool."""
        tick = self.settings.ingest_tick_ms / 1000
        try:
            while not self.workers.stopping.is_set():
                batch = drain(self.transport.inbox, self.settings.ingest_max_batch, tick)
                if batch:
                    self._staged.put((batch, self._classify(batch)))
        finally:
            self._staged.put(None)

    def _store_loop(self) -> None:
        """Store the staged batches in order; flush receipts as they fall due."""
        tick = self.settings.ingest_tick_ms / 1000
        while True:
            try:
                staged = self._staged.get(timeout=tick)
            except queue.Empty:
                self._flush_receipts()
                continue
            if staged is None:
                break
            # Every batch staged by now goes into this one store: one blob flush and one
            # commit for all of them. Their cost is the disk's flush latency more than
            # the CPU, so under load the batches grow instead of queueing behind it.
            messages, pending = staged
            last = False
            while not last:
                try:
                    more = self._staged.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    last = True
                else:
                    messages, pending = messages + more[0], pending + more[1]
            try:
                outcomes = [outcome for future in pending for outcome in future.result()]
                with_retries(
                    functools.partial(self._store_attempt, messages, outcomes, []),
                    stopping=self.workers.stopping,
                    on_failure=self.metrics.store_errors.inc,
                )
            finally:
                self.transport.budget.release(len(messages), sum(m.held for m in messages))
            self._flush_receipts()
            if last:
                break
        self._flush_receipts(everything=True)

    def _classify(self, messages: list[Inbound]) -> list[Future[list[Classified]]]:
        """Classify ``messages`` on the decoder pool, in a few chunks (one task per message
        would cost more in hand-offs than a small image takes to decode)."""
        classify_one = functools.partial(
            classify,
            topics=self.topics,
            limits=self.limits,
            input_size=self.verdicts.teacher.input_size,
            keep_bytes=self.settings.dead_letter_keep_bytes,
            decode_pool=self.decode_pool,
        )
        guarded = self.guard.guard(classify_one)
        items = [(m.topic, m.payload, m.size) for m in messages]

        def run(chunk: Sequence[tuple[str, bytes, int]]) -> list[Classified]:
            return [guarded(topic, payload, size) for topic, payload, size in chunk]

        if len(items) == 1:
            done: Future[list[Classified]] = Future()
            done.set_result(run(items))
            return [done]
        size = -(-len(items) // (2 * self._decode_workers))
        return [self._decoders.submit(run, items[i : i + size]) for i in range(0, len(items), size)]

    # --- one batch ---------------------------------------------------------------

    def _store_attempt(
        self, messages: list[Inbound], outcomes: list[Classified], images: list[BlobBatch]
    ) -> None:
        """One attempt to ``store`` a batch; ``images`` keeps its blob batch once made,
        so every attempt writes the same pack (at most once)."""
        if not images:
            images.append(self._images(outcomes))
        self.store(messages, outcomes, images[0])

    def _images(self, outcomes: list[Classified]) -> BlobBatch:
        """The blob batch of the samples among ``outcomes``, in order; written at most
        once, so retries of a store (a database outage) do not write its images again."""
        images = [(o.image_key, o.image) for o in outcomes if isinstance(o, IngestSample)]
        batch = self.blobs.batch(images)
        written = threading.Event()

        def write_once() -> None:
            if not written.is_set():
                batch.write()
                written.set()

        return BlobBatch(batch.keys, write_once, batch.fresh, batch.settle)

    def store(self, messages: list[Inbound], outcomes: list[Classified], images: BlobBatch) -> None:
        """Make one classified batch durable, then ack, receipt and queue it for the teacher.

        ``images``: ``_images(outcomes)``, the same for every attempt (``_store_attempt``).
        """
        now = datetime.now(UTC)
        samples: list[IngestSample] = []
        dead: list[DeadLetterRow] = []
        statuses: list[IngestStatus | IngestModelStatus] = []
        for outcome in outcomes:
            if isinstance(outcome, IngestSample):
                samples.append(outcome)
            elif isinstance(outcome, DeadLetterRow):
                dead.append(outcome)
            elif outcome is not None:
                statuses.append(outcome)
        # Images and rows are written side by side, and the rows commit only once the
        # images are durable: a row never points at an image that is not there. The
        # images of samples not stored (a redelivered sample's second copy) are deleted
        # after the commit. Should this process die before the batch settles, a live
        # verifier's recovery scan deletes what of its images no row points at
        # (``BlobStore.sweep_abandoned``).
        written = self._blob_writer.submit(images.write) if samples else None
        offered = list(zip(samples, images.keys, strict=True))
        try:
            with self.sessions.begin() as session:
                rows = [sample_row(sample, now, key) for sample, key in offered]
                stored = crud.store_samples(session=session, rows=rows)
                unplaced = [s for s in samples if _key(s) not in stored]
                dead = dead + [_id_conflict(s) for s in unplaced]
                samples = [s for s in samples if _key(s) in stored]
                crud.insert_dead_letters(session=session, rows=[d.row(now) for d in dead])
                for item in statuses:
                    if isinstance(item, IngestStatus):
                        crud.record_agent_status(session=session, status=item.status)
                    else:
                        crud.record_model_status(session=session, status=item.status)
                duplicates = [cloud_id for cloud_id, new in stored.values() if not new]
                stored_verdicts = (
                    crud.get_verdicts(session=session, sample_ids=duplicates) if duplicates else []
                )
                republish = [self.verdicts.verdict_from_row(v) for v in stored_verdicts]
                if written is not None:
                    written.result()  # raises the blob store's error: the rows roll back
        finally:
            if written is not None:
                wait([written])  # one writer per batch at a time, even on a retry
        # Durable: now the broker may forget these messages.
        self.transport.ack(messages)
        if images.fresh:
            self._discard_unstored(offered, stored)
        images.settle()  # committed: no sweep need look at these images again
        new_keys = {key for key, (_cloud_id, new) in stored.items() if new}
        self._account(samples, new_keys, dead)
        self.guard.record_isolations(self.sessions)
        if republish:
            self.verdicts.publish_many(republish)
        fresh: dict[str, SampleTask] = {}
        for sample in samples:
            cloud_id, new = stored[_key(sample)]
            if new and cloud_id not in fresh:
                fresh[cloud_id] = sample.task(self.verdicts.task, cloud_id)
        self.verdicts.submit_many(list(fresh.values()))
        self.metrics.queue_depth.set(self.verdicts.batcher.depth)

    def _discard_unstored(
        self,
        offered: list[tuple[IngestSample, str]],
        stored: dict[crud.SampleKey, tuple[str, bool]],
    ) -> None:
        """Delete the images of a batch's samples that no row points at: a sample stored
        before (redelivered), a second copy in the same batch (``crud.store_samples``
        stores the first), one that could not be given an id. Their keys are the
        batch's own."""
        placed: set[crud.SampleKey] = set()
        for sample, key in offered:
            sample_key = _key(sample)
            entry = stored.get(sample_key)
            if entry is not None and entry[1] and sample_key not in placed:
                placed.add(sample_key)  # its row points at this image
                continue
            try:
                self.blobs.delete(key)
            except StoreError as exc:  # the bytes stay; nothing points at them
                log.warning("could not delete the unstored image %s: %s", key, exc)
            else:
                self.counts["images_discarded"] += 1
                self.metrics.images_discarded.inc()

    def _account(
        self, samples: list[IngestSample], new_keys: set[crud.SampleKey], dead: list[DeadLetterRow]
    ) -> None:
        m = self.metrics
        by_agent: dict[tuple[str, str], list[str]] = {}
        for sample in samples:
            h = sample.header
            by_agent.setdefault((h.fleet, h.agent), []).append(h.sample_id)
        for (fleet, agent), ids in by_agent.items():
            # Receipts carry the agent's own ids, whatever the cloud stored them under.
            self.receipts.add(fleet, agent, ids)
            m.forwarded.labels(fleet, agent).inc(len(ids))
        new_by_fleet: Counter[str] = Counter(fleet for fleet, _agent, _id in new_keys)
        for fleet, count in new_by_fleet.items():
            m.ingested.labels(fleet).inc(count)
        if len(samples) > len(new_keys):
            m.duplicates.inc(len(samples) - len(new_keys))
        self.counts["stored"] += len(new_keys)
        self.counts["duplicates"] += len(samples) - len(new_keys)
        self.counts["dead_letters"] += len(dead)
        self.guard.log_dead_letters(dead)

    def _flush_receipts(self, *, everything: bool = False) -> None:
        for fleet, agent, ids in self.receipts.due(everything=everything):
            unique = list(dict.fromkeys(ids))
            receipt = Receipt(sample_ids=unique, stored_at=datetime.now(UTC))
            self.transport.publish(self.topics.receipts(fleet, agent), encode_message(receipt))
            self.metrics.receipts.inc(len(unique))


def _key(sample: IngestSample) -> crud.SampleKey:
    h = sample.header
    return (h.fleet, h.agent, h.sample_id)


def _id_conflict(sample: IngestSample) -> DeadLetterRow:
    """The dead letter of a sample every candidate cloud id of which was held."""
    h = sample.header
    return DeadLetterRow(
        topic="",
        reason="sample_id_conflict",
        message=f"sample id {h.sample_id} and its cloud ids are held by other samples",
        payload=b"",
        payload_size=h.image_bytes,
        fleet=h.fleet,
        agent_id=h.agent,
        sample_id=h.sample_id,
    )
