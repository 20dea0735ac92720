"""The verifier process: MQTT ingest, storage, teacher batches, verdicts, receipts.

Threads, each with one job:

    paho loop        on_message -> inbox (nothing else runs on paho's thread); the inbox
                     budget bounds, by count and bytes, everything held from here until
                     a batch is stored: a QoS 1 message waits for room (paho stops
                     reading, TCP pushes back on the broker), a QoS 0 one is dropped
    ingest           inbox -> a batch of messages, classified (envelope checks, image
                     decode) in chunks on the decoder pool -> staged
    decode-N         the pool: OpenCV releases the GIL, so decoding uses every core
    store            staged batches in order -> blobs (one flush) + one DB transaction
                     -> ack -> receipts, new samples -> batcher; while it waits on the
                     disk and the database, the next batch is being decoded
    teacher-N        the teacher on same-shape batches (cloud_service.batcher)
    verdicts         results -> verdict rows (one transaction per drain) -> publish
    recovery         stored samples still "pending" (a crash, a failed batch) -> batcher

A message is acknowledged to the broker (paho manual ack) only after its blob is
written and its row committed; a sample redelivered after a crash is stored once
(ON CONFLICT DO NOTHING on sample_id) and gets at most one verdict row (unique
sample_id on verdicts). Sample ids are unique per agent: a sample whose id another
agent's sample holds is stored under a derived cloud id (``crud.store_samples``)
and answered with its own.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.batcher import (
    BatcherClosedError,
    BatcherConfig,
    BatchInfo,
    DynamicBatcher,
    QueueFullError,
)
from cloud_service.blobs import BlobStore, open_blob_store
from cloud_service.db import crud
from cloud_service.db.models import Sample
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.ingest import (
    AgentBreaker,
    Classified,
    DeadLetterRow,
    InboxBudget,
    IngestModelStatus,
    IngestSample,
    IngestStatus,
    ReceiptBuffer,
    SampleTask,
    classify,
    sample_row,
)
from cloud_service.metrics import CloudMetrics
from cloud_service.review import ReviewRules
from cloud_service.settings import CloudSettings
from cloud_service.verifier import TeacherModel, TeacherScore, decode_image
from shared.decode_pool import DecodePool
from shared.envelope import PREFIX_SIZE
from shared.errors import EdgeLoopError, StoreError, TransportError
from shared.interpreter import SwitchInterval
from shared.messages import DEFAULT_MAX_MESSAGE_BYTES, Receipt, Verdict, encode_message
from shared.mqtt import make_client, negotiate_protocol
from shared.topics import TopicRef

__all__ = ["VerifierWorker", "batcher_config"]

log = logging.getLogger(__name__)

# Broker-side window of unacknowledged messages to us (MQTT v5 Receive Maximum):
# with manual acks after each commit, the window must cover a whole ingest batch.
_RECEIVE_MAXIMUM = 2000
_RETRY_BACKOFF = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True, slots=True)
class Inbound:
    """One received message as the worker holds it (paho's message object is let go)."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    size: int  # bytes as received; ``payload`` is empty when it was over every limit

    @property
    def held(self) -> int:
        return len(self.payload)


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
        self.limits = settings.envelope_limits
        self.metrics = metrics or CloudMetrics()
        if session_factory is None:
            url = settings.resolved_database_url
            if migrate:
                upgrade_database(url)
            self._engine: Engine | None = make_engine(url)
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
        self.rules = ReviewRules(
            confidence_below=settings.review_confidence_below,
            on_disagreement=settings.review_on_disagreement,
            audit_share=settings.review_audit_share,
        )
        self.batcher: DynamicBatcher[SampleTask, TeacherScore] = DynamicBatcher(
            self._run_batch, batcher_config(settings), on_batch=self._on_batch, name="teacher"
        )
        self.receipts = ReceiptBuffer(
            flush_s=settings.receipt_flush_ms / 1000, max_ids=settings.receipt_max_ids
        )
        # Bounded by ``inbox`` (count and bytes), which covers every message from
        # on_message until its batch is stored: this queue, the ingest thread's batch,
        # the staged batches and the store thread's.
        self._inbox: queue.Queue[Inbound] = queue.Queue()
        self.inbox = InboxBudget(
            max_messages=settings.inbox_max_messages, max_bytes=settings.inbox_max_bytes
        )
        self.metrics.inbox_messages.set_function(lambda: self.inbox.messages)
        self.metrics.inbox_bytes.set_function(lambda: self.inbox.bytes)
        # No message the cloud takes is larger; a bigger one is dead-lettered unread.
        self._max_payload = max(
            PREFIX_SIZE + self.limits.max_header_bytes + self.limits.max_image_bytes,
            DEFAULT_MAX_MESSAGE_BYTES,
        )
        self._dead_letter_log = _LogLimiter(settings.breaker_log_every_s)
        # Image decode is ingest's largest cost and OpenCV releases the GIL while it
        # decodes and resizes, so a small pool spreads one ingest batch over the cores.
        self._decode_workers = min(4, os.cpu_count() or 1)
        self._decoders = ThreadPoolExecutor(
            max_workers=self._decode_workers, thread_name_prefix="decode"
        )
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
        # Writes a batch's images while its rows are inserted: the transaction commits
        # only once they are durable, so a row never points at a missing image.
        self._blob_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blobs")
        # Batches classified (or being classified) and waiting for the store thread, in
        # arrival order; two at most, so a slow store holds messages in the inbox, where
        # they form bigger batches, not here. None: the ingest thread stopped.
        self._staged: queue.Queue[tuple[list[Inbound], list[Future[list[Classified]]]] | None] = (
            queue.Queue(maxsize=2)
        )
        # Each teacher batch's results as one item: (task, scores or the batch's error).
        self._results: queue.Queue[list[tuple[SampleTask, TeacherScore | BaseException]]] = (
            queue.Queue()
        )
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self.breaker = AgentBreaker(
            window_s=settings.breaker_window_s,
            min_messages=settings.breaker_min_messages,
            error_rate=settings.breaker_error_rate,
            cooldown_s=settings.breaker_cooldown_s,
        )
        self.shed_count = 0
        self._breaker_lock = threading.Lock()  # classify runs on the decoder pool
        self._isolated_shown: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._switch_interval = SwitchInterval(settings.verifier_switch_interval_ms)
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.protocol = "5"
        self.client: mqtt.Client | None = None
        self.counts = {"stored": 0, "duplicates": 0, "dead_letters": 0, "verdicts": 0}

    # --- lifecycle -----------------------------------------------------------

    def __enter__(self) -> VerifierWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def ready(self) -> bool:
        return self._subscribed.is_set() and self._connected.is_set()

    def start(self, *, connect_timeout: float = 15.0) -> None:
        # The MQTT thread releases the GIL on every socket read and must win it back from
        # threads that decode, store and score; at CPython's default interval it could
        # take in only a few hundred messages a second.
        self._switch_interval.apply()
        self.batcher.start()
        for name, target in (
            ("ingest", self._ingest_loop),
            ("store", self._store_loop),
            ("verdicts", self._verdict_loop),
            ("recovery", self._recovery_loop),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            self._connect(connect_timeout)
        except BaseException:
            self._switch_interval.restore()
            raise

    def stop(self) -> None:
        """Stop taking messages, finish what is in hand, flush receipts, disconnect."""
        if self._stop.is_set():
            return
        # First, so an MQTT thread waiting for room in a full inbox returns (its message
        # unacked: the broker redelivers it) and nothing new is taken in.
        self.inbox.close()
        client = self.client
        if client is not None:
            # Unsubscribing is not needed: the session keeps the subscription, and a
            # restarted verifier with the same client id receives what queued meanwhile.
            client.on_message = None
        self._stop.set()
        for name in ("ingest", "store"):
            for thread in self._threads:
                if thread.name == name:
                    thread.join(10)
        self.batcher.close(drain=True)
        for thread in self._threads:
            thread.join(10)
        self._threads.clear()
        self._decoders.shutdown(wait=True)
        self.decode_pool.close()
        self._blob_writer.shutdown(wait=True)
        if client is not None:
            client.disconnect()
            client.loop_stop()
        if self._engine is not None:
            self._engine.dispose()
        self._switch_interval.restore()

    def _connect(self, timeout: float) -> None:
        settings = self.settings
        target = settings.mqtt
        self.protocol = negotiate_protocol(target)
        client = make_client(
            target,
            client_id=settings.verifier_client_id,
            protocol=self.protocol,
            clean_start=False,
            ca_file=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None,
            manual_ack=True,
        )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.reconnect_delay_set(1, 5)
        client.max_queued_messages_set(0)
        client.max_inflight_messages_set(200)
        self.client = client
        kwargs: dict[str, Any] = {"keepalive": 30}
        if self.protocol == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = settings.mqtt_session_expiry_s
            props.ReceiveMaximum = min(_RECEIVE_MAXIMUM, settings.inbox_max_messages)
            kwargs.update(clean_start=False, properties=props)
        try:
            client.connect(target.host, target.port, **kwargs)
        except OSError as exc:
            raise TransportError(
                f"cannot reach the MQTT broker at {target.host}:{target.port}: {exc}"
            ) from exc
        client.loop_start()
        if not self._subscribed.wait(timeout):
            raise TransportError(f"no subscription acknowledged by the broker within {timeout} s")

    def subscriptions(self) -> list[str]:
        group = self.settings.verifier_group if self.protocol == "5" else None
        return [
            self.topics.samples_filter(group),
            self.topics.model_status_filter(group),
            # Plain, never shared: retained statuses are not sent to shared
            # subscriptions, and every verifier may upsert the same status.
            self.topics.status_filter(),
        ]

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if getattr(reason, "is_failure", False):
            log.error("broker refused the connection: %s", reason)
            return
        self._connected.set()
        log.info("connected to the broker (session present: %s)", flags.session_present)
        client.subscribe([(topic, 1) for topic in self.subscriptions()])

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any
    ) -> None:
        failures = [c for c in codes if getattr(c, "is_failure", False)]
        if failures:
            log.error("broker refused subscriptions: %s", failures)
            return
        self._subscribed.set()

    def _on_disconnect(self, client: mqtt.Client, *args: Any) -> None:
        self._connected.clear()
        if not self._stop.is_set():
            log.warning("disconnected from the broker; paho reconnects")

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        payload = bytes(message.payload)  # the same object when it is bytes already
        size = len(payload)
        if size > self._max_payload:
            payload = b""  # dead-lettered as too_large without keeping its bytes
        if message.qos == 0:
            # Nothing depends on a QoS 0 message arriving, and nothing would resend it:
            # with the inbox full it is dropped here rather than held.
            if not self.inbox.try_acquire(len(payload)):
                if not self.inbox.closed:  # not merely stopping
                    self.metrics.inbox_dropped.labels("qos0_inbox_full").inc()
                return
        else:
            if not self.inbox.try_acquire(len(payload)):
                self.metrics.inbox_waits.inc()
                # Wait on paho's thread: it stops reading the socket, so TCP pushes back
                # on the broker and its own queue limits apply. Unacked, the message
                # stays the broker's until it is stored.
                if not self.inbox.acquire(len(payload)):
                    return  # stopping: left unacked, the broker delivers it again
        self._inbox.put(Inbound(message.topic, payload, message.qos, message.mid, size))

    # --- ingest --------------------------------------------------------------

    def _drain(self, inbox: queue.Queue[Any], limit: int, wait: float) -> list[Any]:
        try:
            items = [inbox.get(timeout=wait)]
        except queue.Empty:
            return []
        while len(items) < limit:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        return items

    def _ingest_loop(self) -> None:
        """Drain the inbox in batches and start classifying each on the decoder pool."""
        tick = self.settings.ingest_tick_ms / 1000
        try:
            while not self._stop.is_set():
                batch = self._drain(self._inbox, self.settings.ingest_max_batch, tick)
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
            messages, pending = staged
            try:
                outcomes = [outcome for future in pending for outcome in future.result()]
                self._with_retries(functools.partial(self._store, messages, outcomes))
            finally:
                self.inbox.release(len(messages), sum(m.held for m in messages))
            self._flush_receipts()
        self._flush_receipts(everything=True)

    def _with_retries(self, step: Callable[[], None]) -> bool:
        """Run ``step`` until it succeeds or we stop; storage outages are waited out."""
        for attempt in range(10_000):
            try:
                step()
                return True
            except (StoreError, SQLAlchemyError, OSError) as exc:
                self.metrics.store_errors.inc()
                delay = _RETRY_BACKOFF[min(attempt, len(_RETRY_BACKOFF) - 1)]
                log.warning("storage failed (%s); retrying in %.1f s", exc, delay)
                if self._stop.wait(delay):
                    return False
        return False

    def _classify(self, messages: list[Inbound]) -> list[Future[list[Classified]]]:
        """Classify ``messages`` on the decoder pool, in a few chunks (one task per message
        would cost more in hand-offs than a small image takes to decode)."""
        classify_one = functools.partial(
            classify,
            topics=self.topics,
            limits=self.limits,
            input_size=self.teacher.input_size,
            keep_bytes=self.settings.dead_letter_keep_bytes,
            decode_pool=self.decode_pool,
        )
        guarded = self._breaker_guard(self._size_guard(classify_one))
        items = [(m.topic, m.payload, m.size) for m in messages]

        def run(chunk: Sequence[tuple[str, bytes, int]]) -> list[Classified]:
            return [guarded(topic, payload, size) for topic, payload, size in chunk]

        if len(items) == 1:
            done: Future[list[Classified]] = Future()
            done.set_result(run(items))
            return [done]
        size = -(-len(items) // (2 * self._decode_workers))
        return [self._decoders.submit(run, items[i : i + size]) for i in range(0, len(items), size)]

    def _store(self, messages: list[Inbound], outcomes: list[Classified]) -> None:
        """Make one classified batch durable, then ack, receipt and queue it for the teacher."""
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
        # images are durable: a row never points at an image that is not there. A crash
        # in between leaves orphan files that the redelivery overwrites.
        images = [(sample.image_key, sample.image) for sample in samples]
        written = self._blob_writer.submit(self.blobs.put_many, images) if images else None
        try:
            with self.sessions.begin() as session:
                stored = crud.store_samples(
                    session=session, rows=[sample_row(s, now) for s in samples]
                )
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
                republish = [self._verdict_from_row(v) for v in stored_verdicts]
                if written is not None:
                    written.result()  # raises the blob store's error: the rows roll back
        finally:
            if written is not None:
                wait([written])  # one writer per batch at a time, even on a retry
        # Durable: now the broker may forget these messages.
        assert self.client is not None
        for message in messages:
            if message.qos > 0:
                self.client.ack(message.mid, message.qos)
        new_keys = {key for key, (_cloud_id, new) in stored.items() if new}
        self._account(samples, new_keys, dead)
        self._record_isolations()
        for verdict in republish:
            self._publish_verdict(verdict)
        fresh: dict[str, SampleTask] = {}
        for sample in samples:
            key = _key(sample)
            cloud_id, new = stored[key]
            if new and cloud_id not in fresh:
                fresh[cloud_id] = sample.task(cloud_id)
        self._submit_many(list(fresh.values()))
        self.metrics.queue_depth.set(self.batcher.depth)

    # --- circuit breaker on malformed data ------------------------------------

    def _size_guard(self, inner: Callable[[str, bytes], Any]) -> Callable[[str, bytes, int], Any]:
        """``inner``, but a message over every limit is dead-lettered without its bytes."""

        def guarded(topic: str, payload: bytes, size: int) -> Any:
            if size <= self._max_payload:
                return inner(topic, payload)
            try:
                ref: TopicRef | None = self.topics.parse(topic)
            except EdgeLoopError:
                ref = None
            return DeadLetterRow(
                topic=topic,
                reason="too_large",
                message=f"message of {size} bytes is over the largest the cloud takes"
                f" ({self._max_payload})",
                payload=b"",
                payload_size=size,
                fleet=ref.fleet if ref else None,
                agent_id=ref.agent if ref else None,
            )

        return guarded

    def _breaker_guard(
        self, inner: Callable[[str, bytes, int], Any]
    ) -> Callable[[str, bytes, int], Any]:
        """``inner`` behind the per-agent breaker, which isolates bad messages, not the agent.

        Anyone who can publish on an agent's topic can trip its breaker, so an open one
        never refuses a well-formed message: every message is still classified, and
        what is taken is taken. While it is open, what is refused is dead-lettered as
        ``isolated`` without its bytes, and logged at most once per interval.
        """

        def guarded(topic: str, payload: bytes, size: int) -> Any:
            try:
                ref = self.topics.parse(topic)
            except EdgeLoopError:
                return inner(topic, payload, size)  # no agent to blame: wrong_topic
            if ref.agent is None:
                return inner(topic, payload, size)
            with self._breaker_lock:
                until = self.breaker.isolated_until(ref.fleet, ref.agent)
            outcome = inner(topic, payload, size)
            refused = isinstance(outcome, DeadLetterRow)
            if until is not None:
                if not refused:
                    return outcome
                return replace(
                    outcome,
                    reason="isolated",
                    message=f"refused ({outcome.reason}) while the breaker of"
                    f" {ref.fleet}/{ref.agent} is open: {outcome.message}",
                    payload=b"",
                )
            with self._breaker_lock:
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

    def _record_isolations(self) -> None:
        """Mirror the breaker into agents.state ('isolated'), so the API shows it."""
        with self._breaker_lock:
            now_isolated = set(self.breaker.isolated())
        opened = now_isolated - self._isolated_shown
        closed = self._isolated_shown - now_isolated
        if not opened and not closed:
            return
        from sqlalchemy import update

        from cloud_service.db.models import Agent

        with self.sessions.begin() as session:
            for (fleet, agent), state in [(k, "isolated") for k in opened] + [
                (k, "unknown") for k in closed
            ]:
                session.execute(
                    update(Agent)
                    .where(Agent.agent_id == agent, Agent.fleet == fleet)
                    .values(state=state)
                )
        self._isolated_shown = now_isolated
        self.metrics.isolated_agents.set(len(now_isolated))

    def _account(
        self, samples: list[IngestSample], new_keys: set[crud.SampleKey], dead: list[DeadLetterRow]
    ) -> None:
        m = self.metrics
        by_agent: dict[tuple[str, str], list[str]] = {}
        for sample in samples:
            h = sample.header
            by_agent.setdefault((h.fleet, h.agent), []).append(h.sample_id)
        new_by_fleet: Counter[str] = Counter()
        for (fleet, agent), ids in by_agent.items():
            # Receipts carry the agent's own ids, whatever the cloud stored them under.
            self.receipts.add(fleet, agent, ids)
            m.forwarded.labels(fleet, agent).inc(len(ids))
        for fleet, _agent, _sample_id in new_keys:
            new_by_fleet[fleet] += 1
        for fleet, count in new_by_fleet.items():
            m.ingested.labels(fleet).inc(count)
        if len(samples) > len(new_keys):
            m.duplicates.inc(len(samples) - len(new_keys))
        self.counts["stored"] += len(new_keys)
        self.counts["duplicates"] += len(samples) - len(new_keys)
        self.counts["dead_letters"] += len(dead)
        for letter in dead:
            m.dead_letters.labels(letter.reason).inc()
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

    def _flush_receipts(self, *, everything: bool = False) -> None:
        client = self.client
        if client is None:
            return
        for fleet, agent, ids in self.receipts.due(everything=everything):
            unique = list(dict.fromkeys(ids))
            receipt = Receipt(sample_ids=unique, stored_at=datetime.now(UTC))
            client.publish(self.topics.receipts(fleet, agent), encode_message(receipt), qos=1)
            self.metrics.receipts.inc(len(unique))

    def _submit(self, task: SampleTask) -> None:
        if self._admit(task):
            shape, priority, order = self._request(task)
            self.batcher.submit(task, shape=shape, priority=priority, order=order)

    def _submit_many(self, tasks: list[SampleTask]) -> None:
        """Queue new samples for the teacher in one hand-off to the batcher."""
        admitted = [task for task in tasks if self._admit(task)]
        if not admitted:
            return
        try:
            self.batcher.submit_many([(task, *self._request(task)) for task in admitted])
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
        # _run_batch, all at once; the future stays the batcher's.
        level = self.batcher.config.priority_levels - 1 - task.priority
        return task.pixels.shape, level, task.edge_confidence

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
        while True:
            stopping = self._stop.is_set() and not any(
                t.name.startswith("teacher") and t.is_alive() for t in threading.enumerate()
            )
            drained = self._drain(self._results, 16, 0.05)
            batch = [item for results in drained for item in results]
            if batch:
                self._with_retries(functools.partial(self._store_verdicts, batch))
            elif stopping:
                return

    def _store_verdicts(
        self, results: list[tuple[SampleTask, TeacherScore | BaseException]]
    ) -> None:
        now = datetime.now(UTC)
        # (the id the sample is stored under, the verdict the agent gets with its own id)
        verdicts: list[tuple[str, Verdict]] = []
        failed: list[SampleTask] = []
        for task, result in results:
            if isinstance(result, BaseException):
                log.error("teacher failed on %s: %s", task.sample_id, result)
                failed.append(task)
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
            again = [self._verdict_from_row(v) for v in stored]
        with self._inflight_lock:
            for task, _ in results:
                self._inflight.discard(task.sample_id)
        m = self.metrics
        agreed = 0
        outcomes: Counter[tuple[str, str]] = Counter()
        for cloud_id, verdict in verdicts:
            if cloud_id in new:
                self._publish_verdict(verdict)
                agreed += verdict.agrees_with_edge
                outcomes[str(verdict.agrees_with_edge).lower(), str(verdict.review).lower()] += 1
                m.capture_to_verdict.observe(max(latency[cloud_id], 0.0))
        for (agrees, review), count in outcomes.items():
            m.verdicts.labels(agrees, review).inc(count)
        m.observe_verdicts(agreed, len(new))
        self.counts["verdicts"] += len(new)
        for verdict in again:
            self._publish_verdict(verdict)

    def _make_verdict(self, task: SampleTask, result: TeacherScore, now: datetime) -> Verdict:
        scores = result.scores
        label = result.label
        confidence = min(max(result.confidence, 0.0), 1.0)
        agrees = label == task.edge_predicted
        reasons = self.rules.reasons(
            sample_id=task.sample_id, teacher_confidence=confidence, agrees_with_edge=agrees
        )
        info = self.teacher.info
        return Verdict(
            sample_id=task.agent_sample_id,
            fleet=task.fleet,
            agent=task.agent,
            teacher_model=info.name,
            teacher_version=info.version,
            scores=scores.tolist(),
            label=label,
            confidence=confidence,
            agrees_with_edge=agrees,
            review=bool(reasons),
            review_reasons=reasons,
            verified_at=now,
        )

    def _verdict_from_row(self, row: Any) -> Verdict:
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

    def _publish_verdict(self, verdict: Verdict) -> None:
        if self.client is not None:
            topic = self.topics.verdicts(verdict.fleet, verdict.agent)
            self.client.publish(topic, encode_message(verdict), qos=1)

    # --- recovery ------------------------------------------------------------

    def _recovery_loop(self) -> None:
        """Verify stored samples without a verdict: at start (a crash) and then now and then."""
        interval = 30.0
        # The first scan takes every pending sample (this verifier may have crashed with
        # them in flight); later ones leave recent samples to whichever verifier of the
        # shared subscription holds them now.
        grace_s = 0.0
        while not self._stop.is_set():
            try:
                self.recover_pending(grace_s=grace_s)
                grace_s = self.settings.recovery_grace_s
            except (SQLAlchemyError, EdgeLoopError, OSError) as exc:
                log.warning("recovery scan failed: %s", exc)
            if self._stop.wait(interval):
                return

    def recover_pending(self, *, limit: int = 100_000, grace_s: float = 0.0) -> int:
        """Submit stored, unverified samples that are not in flight here; return how many.

        Samples stored in the last ``grace_s`` seconds are left alone.
        """
        count = 0
        after = ""
        size = self.teacher.input_size
        received_before = datetime.now(UTC) - timedelta(seconds=grace_s) if grace_s else None
        while count < limit and not self._stop.is_set():
            with self.sessions() as session:
                rows = crud.pending_samples(
                    session=session, limit=500, after=after, received_before=received_before
                )
            if not rows:
                break
            after = rows[-1].sample_id
            for row in rows:
                with self._inflight_lock:
                    if row.sample_id in self._inflight:
                        continue
                try:
                    pixels = decode_image(
                        self.blobs.get(row.image_key), size, pool=self.decode_pool
                    )
                except EdgeLoopError as exc:
                    log.error("cannot recover sample %s: %s", row.sample_id, exc)
                    continue
                self._submit(
                    SampleTask(
                        sample_id=row.sample_id,
                        fleet=row.fleet,
                        agent=row.agent_id,
                        captured_at=row.captured_at,
                        edge_predicted=row.edge_predicted,
                        edge_confidence=row.edge_confidence,
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


def _without_pixels(task: SampleTask) -> SampleTask:
    return replace(task, pixels=_NO_PIXELS)


_NO_PIXELS = np.zeros((0,), np.uint8)
