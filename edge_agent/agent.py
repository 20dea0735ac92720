"""The Agent: frames in, answers out at once, unsure frames to the spool and the cloud.

    with Agent(settings, engine=engine, publisher=link, clock=time.time) as agent:
        result = agent.process(rgb, source="http")

Entering starts the named background threads and stopping ends them in reverse:

- ``inference-loop``  (MicroBatcher) batches frames across sources and runs the student
- ``agent-post-*``    routes each inferred batch at once (one hand-over per batch),
                      answers its confident frames, then encodes the forwarded ones
- ``spool-writer``    stores forwarded samples a micro-batch at a time (one transaction);
                      a forwarded frame is answered once its sample is committed, and
                      the batch is published right after, while the link keeps up
- ``uplink-pump``     publishes what is due in the spool (samples stored while the link
                      was down or backed up, resends) and applies held receipts
- ``heartbeat-loop``  publishes the retained AgentStatus every ``heartbeat_s``
- ``mqtt-io``         (MqttLink) the one thread that touches paho
- ``webhook-loop``    posts verdicts to the user's application, when configured (a bounded
                      queue, retries with jittered backoff; inference never waits for it)
- ``model-updater``   (ModelUpdater) verifies, downloads and swaps in announced models
- one thread per camera and folder source

Verdicts are also kept in a SQLite file beside the spool's (``VerdictStore``, the
newest ``verdicts_kept``), so ``GET /v1/samples/{id}`` still shows them after a restart.

Every I/O edge is a constructor argument (engine, publisher, clock), so tests swap
the expensive ones for doubles and keep the cheap real ones (SQLite, Mosquitto).
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
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from edge_agent.batcher import JobBatch, MicroBatcher, WorkerPool
from edge_agent.engine import Engine, EngineOptions, OrtEngine
from edge_agent.imaging import (
    DecodedImage,
    ModelFrame,
    decode_for_model,
    decode_image,
    encode_for_upload,
    prepare_bgr,
    resize_for_model,
)
from edge_agent.routing import Decision, Router
from edge_agent.settings import AgentSettings
from edge_agent.spool import NewSample, Spool, SpoolWriter, connect
from edge_agent.telemetry import Telemetry
from edge_agent.updates import (
    ModelUpdater,
    active_model_path,
    max_supported_opset,
    runtime_version,
)
from edge_agent.uplink import Backoff, MqttLink, Publisher
from shared.decode_pool import DecodePool
from shared.envelope import encode_envelope
from shared.errors import EdgeLoopError, MessageError, StoreError
from shared.ids import new_sample_id
from shared.images import ImageInfo
from shared.interpreter import SwitchInterval
from shared.messages import (
    AgentStatus,
    Receipt,
    SampleHeader,
    Verdict,
    decode_message,
    encode_message,
)

__all__ = ["Agent", "FrameResult", "Reply", "VerdictStore", "build_engine", "build_publisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrameResult:
    """The agent's answer for one frame."""

    sample_id: str
    label: str
    predicted: int
    scores: list[float]
    confidence: float
    forwarded: bool
    route_reason: str | None
    priority: int
    over_budget: bool
    latency_ms: float
    model_name: str
    model_version: str
    source: str

    def as_dict(self) -> dict[str, Any]:
        # Flat fields only: cheaper than dataclasses.asdict's deep copy on the hot path.
        return {name: getattr(self, name) for name in _RESULT_FIELDS}


_RESULT_FIELDS = tuple(f.name for f in fields(FrameResult))


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
        self._writer = threading.Thread(target=self._run, name="verdict-writer", daemon=True)
        self._writer.start()

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
        row = (now, json.dumps(verdict), json.dumps(result) if result is not None else None)
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

    def close(self) -> None:
        """Write what is queued, then close the file."""
        with self._queue:
            self._closed = True
            self._queue.notify_all()
        self._writer.join(10.0)
        with self._lock:
            self._db.close()


def build_engine(settings: AgentSettings, path: Path | None = None) -> OrtEngine:
    """The ORT student from settings (providers by preference, warm-up, TensorRT cache)."""
    options = EngineOptions(
        providers=tuple(settings.providers) if settings.providers else None,
        intra_op_threads=settings.intra_op_threads,
        spinning=settings.ort_spinning,
        trt_cache_dir=settings.resolved_trt_cache_dir,
        trt_fp16=settings.trt_fp16,
        trt_int8=settings.trt_int8,
        warmup_runs=settings.warmup_runs,
        warmup_batch=settings.max_batch,
    )
    return OrtEngine(path or settings.resolved_model_path, options)


def _status_payload(settings: AgentSettings, state: str, **fields: Any) -> bytes:
    status = AgentStatus(
        fleet=settings.fleet,
        agent=settings.agent_id,
        state=state,
        sent_at=datetime.now(UTC),
        **{k: v for k, v in fields.items() if v is not None},
    )
    return encode_message(status)


def build_publisher(settings: AgentSettings) -> MqttLink:
    """The real MQTT link from settings: persistent session, last will 'offline'."""
    topics = settings.topics
    fleet, agent = settings.fleet, settings.agent_id
    return MqttLink(
        settings.mqtt,
        client_id=f"edgeloop-agent-{fleet}-{agent}",
        subscriptions=[
            topics.receipts(fleet, agent),
            topics.verdicts(fleet, agent),
            topics.fleet_models(fleet),
            topics.agent_models(fleet, agent),
        ],
        will=(topics.status(fleet, agent), _status_payload(settings, "offline")),
        protocol=None if settings.mqtt_protocol == "auto" else settings.mqtt_protocol,
        keepalive_s=settings.mqtt_keepalive_s,
        backoff_min_s=settings.reconnect_min_s,
        backoff_max_s=settings.reconnect_max_s,
        ca_file=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None,
    )


Reply = Callable[[FrameResult | None, BaseException | None], None]


class _Job:
    """One queued frame: what routing and its answer need once the batch is inferred."""

    __slots__ = ("bgr", "captured", "encoded", "frame", "info", "reply", "source", "started")

    def __init__(
        self,
        frame: np.ndarray | None,
        bgr: bool,
        source: str,
        encoded: bytes | None,
        info: ImageInfo | None,
        started: float,
        reply: Reply,
    ) -> None:
        self.frame = frame  # the frame as captured, kept for re-encoding when forwarded
        self.bgr = bgr
        self.source = source
        self.encoded = encoded
        self.info = info
        self.started = started
        self.reply = reply
        self.captured = time.time()  # made a datetime only for a forwarded frame

    @property
    def captured_at(self) -> datetime:
        return datetime.fromtimestamp(self.captured, UTC)


class _FutureReply:
    """A Reply that settles a concurrent Future (what ``Agent.submit`` returns)."""

    __slots__ = ("future",)

    def __init__(self, future: Future[FrameResult]) -> None:
        self.future = future

    def __call__(self, result: FrameResult | None, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)  # type: ignore[arg-type]


def _fail_all(jobs: list[_Job], error: BaseException) -> None:
    """Answer every job with ``error``."""
    for job in jobs:
        try:
            job.reply(None, error)
        except Exception:  # one reply's failure must not leave the others unanswered
            log.exception("a frame's reply failed")


class Agent:
    """One edge agent; a context manager that owns its background threads."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        engine: Engine | None = None,
        publisher: Publisher | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        start_sources: bool = True,
        model_transport: Any = None,
    ) -> None:
        self.settings = settings
        self._engine_arg = engine
        self._publisher_arg = publisher
        self.clock = clock
        self._rng = rng or random.Random()
        self.start_sources = start_sources
        self._model_transport = model_transport  # httpx transport for downloads (tests)
        self.telemetry = Telemetry()
        topics = settings.topics
        fleet, agent_id = settings.fleet, settings.agent_id
        self.topic_samples = topics.samples(fleet, agent_id)
        self.topic_receipts = topics.receipts(fleet, agent_id)
        self.topic_verdicts = topics.verdicts(fleet, agent_id)
        self.topic_status = topics.status(fleet, agent_id)
        self._limits = settings.envelope_limits
        self._router_lock = threading.Lock()  # Router keeps budget state
        self._results_lock = threading.Lock()
        self._results: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._stopping = threading.Event()
        self._spooled = threading.Event()  # wakes the uplink pump
        self._threads: list[threading.Thread] = []
        self._sources: list[Any] = []
        self._webhook_queue: queue.Queue[dict[str, Any]] = queue.Queue(settings.webhook_queue)
        self.ready = False
        self.started_at = time.monotonic()
        self.spool_errors = 0
        self._routing = 0  # answered frames not yet routed (and encoded when forwarded)
        self._routing_lock = threading.Lock()
        # Receipts that arrive while samples are being published are held and applied
        # with the next spool transaction (a writer batch or the pump's sent-mark).
        self._receipts_lock = threading.Lock()
        self._publishing = 0
        self._held_receipts: list[str] = []
        # True until the pump has found the spool drained since the last (re)connect:
        # until then new samples queue behind the backlog instead of jumping it.
        self._uplink_backlogged = True
        self._check_due = True  # something may be due that nobody published yet
        self._switch_interval = SwitchInterval(settings.switch_interval_ms)
        # Progressive and costly uploads decode in these processes, within a budget;
        # created by start(), its workers on the first such image.
        self.decode_pool: DecodePool | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> Agent:
        s = self.settings
        self.decode_pool = DecodePool(
            s.decode_workers,
            budget_s=s.decode_budget_ms / 1000,
            isolate_cost=s.decode_isolate_cost,
            max_result_bytes=3 * s.max_pixels,
            preload=("edge_agent.imaging",),
            name="agent-decode",
        )
        self.engine: Engine = self._engine_arg or build_engine(s, active_model_path(s))
        self.spool = Spool(
            s.resolved_spool_path, max_bytes=s.spool_max_bytes, max_samples=s.spool_max_samples
        )
        # Forwarded samples gather while their batch's other frames are still being
        # routed, for at most as long as the micro-batcher waits to fill a batch.
        self.spool_writer = SpoolWriter(
            self.spool,
            clock=self.clock,
            window_s=s.max_wait_ms / 1000.0,
            max_batch=2 * max(1, s.max_batch),
            uplink=_FreshSamples(self),
            expecting=lambda: self._routing > 0,
        ).start()
        self.verdicts = VerdictStore(
            s.resolved_verdicts_path, keep=s.verdicts_kept, moved_from=s.resolved_spool_path
        )
        self.router = Router(
            s.routing_policy, labels=list(self.engine.labels), clock=self.clock, rng=self._rng
        )
        self.batcher = MicroBatcher(
            self.engine,
            max_batch=s.max_batch,
            max_wait_s=s.max_wait_ms / 1000.0,
            on_batch=self._on_batch,
        ).start()
        self._post = WorkerPool(2, name="agent-post")
        self.publisher: Publisher = self._publisher_arg or build_publisher(s)
        self.updater = ModelUpdater(
            s,
            publish=lambda topic, payload: self.publisher.publish(topic, payload, qos=1),
            current=lambda: self.engine,
            swap=self.swap_engine,
            engine_factory=lambda path: build_engine(s, path),
            transport=self._model_transport,
        ).start()
        self.publisher.set_handlers(on_message=self.handle_message, on_connect=self._on_connect)
        self.publisher.start()
        self._spawn("uplink-pump", self._pump_loop)
        self._spawn("heartbeat-loop", self._heartbeat_loop)
        if s.webhook_url:
            self._spawn("webhook-loop", self._webhook_loop)
        # The HTTP event loop and the MQTT thread give the GIL up on every socket call,
        # the decoders on every decode; a shorter interval hands it back to them sooner.
        self._switch_interval.apply()
        if self.start_sources:
            self._start_sources()
        self.ready = True
        log.info(
            "agent %s/%s ready: model %s %s on %s",
            s.fleet,
            s.agent_id,
            self.engine.name,
            self.engine.version,
            self.engine.provider,
        )
        return self

    def _start_sources(self) -> None:
        from edge_agent.sources.camera import CameraReader
        from edge_agent.sources.folder import FolderWatcher

        batch = max(1, self.settings.max_batch)
        for camera in self.settings.cameras:
            # A video file may keep two batches in flight, so its reader decodes the next
            # batch while one is inferred; a live camera keeps one, to answer fresh frames.
            inflight = 2 * batch if Path(camera.uri).is_file() else batch
            self._sources.append(CameraReader(camera, self, max_inflight=inflight).start())
        for folder in self.settings.folders:
            self._sources.append(FolderWatcher(folder, self).start())

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self.ready = False
        for source in self._sources:
            source.stop()
        self._stopping.set()
        self._spooled.set()
        self.updater.stop()
        self.batcher.stop()
        self._post.shutdown(wait=True)
        self.spool_writer.stop()  # stores (and answers) what is still queued
        for thread in self._threads:
            thread.join(5.0)
        # A clean disconnect does not fire the will: say "offline" ourselves.
        if self.publisher.connected:
            self.publisher.publish(
                self.topic_status, _status_payload(self.settings, "offline"), qos=1, retain=True
            )
            flush = getattr(self.publisher, "flush", None)
            if flush is not None:
                flush(2.0)
        self.publisher.stop()
        self.spool.close()
        self.verdicts.close()
        if self.decode_pool is not None:
            self.decode_pool.close()
        self._switch_interval.restore()

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def swap_engine(self, engine: Engine) -> None:
        """Serve from ``engine`` from the next batch on (the batch in flight ends on the old)."""
        self.batcher.swap_engine(engine)
        self.engine = engine

    # --- frames ------------------------------------------------------------------------

    def decode(self, body: bytes) -> DecodedImage:
        """Check and decode an upload (raises ImageRejected naming what is accepted)."""
        return decode_image(
            body,
            max_bytes=self.settings.max_image_bytes,
            max_pixels=self.settings.max_pixels,
            pool=self.decode_pool,
        )

    def decode_for_model(self, body: bytes) -> ModelFrame:
        """Check an upload and decode it straight to the model's input (raises ImageRejected)."""
        return decode_for_model(
            body,
            self.engine.input_hw,
            max_bytes=self.settings.max_image_bytes,
            max_pixels=self.settings.max_pixels,
            pool=self.decode_pool,
        )

    def submit(
        self,
        rgb: np.ndarray,
        *,
        source: str,
        encoded: bytes | None = None,
        info: ImageInfo | None = None,
        block: bool = True,
    ) -> Future[FrameResult]:
        """Queue one RGB frame; the future resolves with the answer (routing included)."""
        started = time.perf_counter()
        tensor = resize_for_model(rgb, self.engine.input_hw)
        return self._submit(tensor, rgb, source, encoded, info, started, block)

    def submit_bgr(
        self, bgr: np.ndarray, *, source: str, block: bool = True
    ) -> Future[FrameResult]:
        """Queue one BGR frame as OpenCV captures it (resized first, then converted to RGB)."""
        started = time.perf_counter()
        tensor = prepare_bgr(bgr, self.engine.input_hw)
        return self._submit(tensor, bgr, source, None, None, started, block, bgr=True)

    def submit_frame(
        self, frame: ModelFrame, *, source: str, block: bool = True
    ) -> Future[FrameResult]:
        """Queue an upload already decoded at the model's size (``decode_for_model``)."""
        started = time.perf_counter()
        tensor = frame.tensor
        if tensor.shape[:2] != self.engine.input_hw:  # the model was swapped meanwhile
            tensor = resize_for_model(tensor, self.engine.input_hw)
        return self._submit(tensor, None, source, frame.encoded, frame.info, started, block)

    def answer_frame(
        self, frame: ModelFrame, reply: Reply, *, source: str, block: bool = True
    ) -> None:
        """Queue an upload decoded at the model's size; ``reply(result, error)`` answers it.

        The reply runs once, on an agent thread, with a FrameResult or the error that
        stopped the frame; a batch's frames are answered together, so a reply should
        only hand the answer on. Raises queue.Full or ModelError when the frame cannot
        be queued at all.
        """
        started = time.perf_counter()
        tensor = frame.tensor
        if tensor.shape[:2] != self.engine.input_hw:  # the model was swapped meanwhile
            tensor = resize_for_model(tensor, self.engine.input_hw)
        job = _Job(None, False, source, frame.encoded, frame.info, started, reply)
        self.batcher.submit_job(tensor, job, block=block)

    def _submit(
        self,
        tensor: np.ndarray,
        rgb: np.ndarray | None,
        source: str,
        encoded: bytes | None,
        info: ImageInfo | None,
        started: float,
        block: bool,
        *,
        bgr: bool = False,
    ) -> Future[FrameResult]:
        outer: Future[FrameResult] = Future()
        job = _Job(rgb, bgr, source, encoded, info, started, _FutureReply(outer))
        self.batcher.submit_job(tensor, job, block=block)
        return outer

    def _on_batch(self, batch: JobBatch) -> None:
        # On the inference thread: hand the batch over, so the next one starts at once.
        jobs: list[_Job] = batch.jobs
        if batch.error is not None:
            _fail_all(jobs, batch.error)
            return
        with self._routing_lock:
            self._routing += len(jobs)
        try:
            self._post.submit(self._finish_batch, batch)
        except RuntimeError as exc:  # the pool is shut down: the agent is stopping
            self._routed(len(jobs))
            _fail_all(jobs, exc)

    def _routed(self, count: int) -> None:
        with self._routing_lock:
            self._routing -= count
            last = self._routing == 0
        if last:
            self.spool_writer.nudge()  # its batch is complete: commit now

    def process(self, rgb: np.ndarray, *, source: str, **kwargs: Any) -> FrameResult:
        """Answer one frame (blocking)."""
        return self.submit(rgb, source=source, **kwargs).result(self.settings.infer_timeout_s)

    def process_upload(self, body: bytes, *, source: str = "http") -> FrameResult:
        """Decode and answer one uploaded JPEG/PNG (blocking)."""
        frame = self.decode_for_model(body)
        return self.submit_frame(frame, source=source).result(self.settings.infer_timeout_s)

    def _finish_batch(self, batch: JobBatch) -> None:
        """Route one inferred batch and answer it: confident frames at once, forwarded
        ones once their samples are spooled (encoded after the others are answered)."""
        jobs: list[_Job] = batch.jobs
        try:
            scores = batch.scores
            assert scores is not None  # a failed batch is answered on the inference thread
            try:
                with self._router_lock:
                    decisions = self.router.decide_batch(scores)
            except BaseException as exc:
                _fail_all(jobs, exc)
                return
            self.telemetry.batch_size.observe(batch.size)
            answered: list[tuple[_Job, FrameResult]] = []
            forwarded: list[tuple[_Job, np.ndarray, Decision, str]] = []
            for job, row, decision in zip(jobs, scores, decisions, strict=True):
                if decision.over_budget:
                    self.telemetry.over_budget.inc()
                sample_id = new_sample_id()
                if decision.forward:
                    forwarded.append((job, row, decision, sample_id))
                    continue
                try:
                    answered.append((job, self._result(job, row, batch, decision, sample_id)))
                except BaseException as exc:
                    job.reply(None, exc)
            self._deliver(answered)
            for job, row, decision, sample_id in forwarded:
                self._forward(job, row, batch, decision, sample_id)
        finally:
            self._routed(len(jobs))

    def _forward(
        self, job: _Job, row: np.ndarray, batch: JobBatch, decision: Decision, sample_id: str
    ) -> None:
        """Spool a forwarded frame's sample, then answer it (unforwarded when that fails)."""
        try:
            sample = self._encode_sample(
                sample_id,
                decision,
                row,
                batch.engine,
                job.frame,
                job.bgr,
                job.encoded,
                job.info,
                job.captured_at,
                job.source,
            )
            if sample is None:
                self._deliver([(job, self._result(job, row, batch, decision, sample_id))])
                return
        except BaseException as exc:
            job.reply(None, exc)
            return

        def stored(ok: bool, error: BaseException | None) -> None:
            if error is not None:
                # The frame is still answered; the failure is counted and shown.
                self.spool_errors += 1
                log.warning("could not spool sample %s: %s", sample_id, error)
            try:
                result = self._result(job, row, batch, decision, sample_id, forwarded=ok)
            except BaseException as exc:
                job.reply(None, exc)
            else:
                self._deliver([(job, result)])

        self.spool_writer.submit(sample, stored)

    def _result(
        self,
        job: _Job,
        row: np.ndarray,
        batch: JobBatch,
        decision: Decision,
        sample_id: str,
        *,
        forwarded: bool = False,
    ) -> FrameResult:
        engine = batch.engine
        labels = engine.labels
        predicted = decision.predicted
        return FrameResult(
            sample_id=sample_id,
            label=labels[predicted] if predicted < len(labels) else str(predicted),
            predicted=predicted,
            scores=row.tolist(),
            confidence=decision.confidence,
            forwarded=forwarded,
            route_reason=decision.reason,
            priority=decision.priority,
            over_budget=decision.over_budget,
            latency_ms=(time.perf_counter() - job.started) * 1e3,
            model_name=engine.name,
            model_version=engine.version,
            source=job.source,
        )

    def _deliver(self, answered: list[tuple[_Job, FrameResult]]) -> None:
        """Count and remember answered frames, then reply to each."""
        if not answered:
            return
        try:
            self.telemetry.record_frames(
                (job.source, r.latency_ms / 1e3, r.forwarded, r.route_reason) for job, r in answered
            )
            self._remember_all([r for _, r in answered])
        except BaseException as exc:
            for job, _ in answered:
                job.reply(None, exc)
            return
        for job, result in answered:
            job.reply(result, None)

    def _encode_sample(
        self,
        sample_id: str,
        decision: Decision,
        scores: np.ndarray,
        engine: Engine,
        frame: np.ndarray | None,
        bgr: bool,
        encoded: bytes | None,
        info: ImageInfo | None,
        captured_at: datetime,
        source: str,
    ) -> NewSample | None:
        """The spool entry for a forwarded frame; None (counted) when it cannot be made."""
        s = self.settings
        try:
            if (
                frame is None
                and encoded is not None
                and info is not None
                and not s.upload_recompress
                and max(info.width, info.height) <= s.upload_max_side
            ):
                image, image_info = encoded, info  # an upload forwarded as received
            else:
                if frame is None:
                    # Decoded at the model's size only: decode the full frame to re-encode it.
                    assert encoded is not None
                    frame, bgr = self.decode(encoded).rgb, False
                image, image_info = encode_for_upload(
                    frame,
                    original=encoded,
                    original_info=info,
                    max_side=s.upload_max_side,
                    quality=s.upload_jpeg_quality,
                    recompress=s.upload_recompress,
                    bgr=bgr,
                )
            payload = self.envelope(
                sample_id=sample_id,
                image=image,
                image_info=image_info,
                captured_at=captured_at,
                model_name=engine.name,
                model_version=engine.version,
                scores=[float(x) for x in scores],
                predicted=decision.predicted,
                confidence=decision.confidence,
                route_reason=decision.reason,
                priority=decision.priority,
                source=source,
            )
        except EdgeLoopError as exc:
            # The frame is still answered; the failure is counted and shown in status.
            self.spool_errors += 1
            log.warning("could not spool sample %s: %s", sample_id, exc)
            return None
        return NewSample(
            sample_id, payload, priority=decision.priority, audit=decision.reason == "audit"
        )

    def envelope(
        self,
        *,
        sample_id: str,
        image: bytes,
        image_info: ImageInfo,
        captured_at: datetime,
        model_name: str,
        model_version: str,
        scores: list[float],
        predicted: int,
        confidence: float,
        route_reason: str | None,
        priority: int,
        source: str,
    ) -> bytes:
        """The sample envelope this agent uploads for an image (raises ContractError)."""
        s = self.settings
        header = SampleHeader(
            sample_id=sample_id,
            fleet=s.fleet,
            agent=s.agent_id,
            captured_at=captured_at,
            model_name=model_name,
            model_version=model_version,
            scores=scores,
            predicted=predicted,
            confidence=min(1.0, max(0.0, confidence)),
            route_reason=route_reason,
            priority=priority,
            image_format=image_info.format,
            image_width=image_info.width,
            image_height=image_info.height,
            image_bytes=len(image),
            meta={"source": source},
        )
        return encode_envelope(header, image, self._limits)

    def _remember_all(self, results: list[FrameResult]) -> None:
        answers = [(r.sample_id, r.as_dict()) for r in results]
        kept = self.settings.results_kept
        with self._results_lock:
            for sample_id, answer in answers:
                self._results.setdefault(sample_id, {})["result"] = answer
            while len(self._results) > kept:
                self._results.popitem(last=False)

    def sample(self, sample_id: str) -> dict[str, Any] | None:
        """The answer and (when it has arrived) the teacher's verdict for a sample id."""
        with self._results_lock:
            entry = self._results.get(sample_id)
            found = dict(entry) if entry is not None else None
        if found is not None and "verdict" in found:
            return found
        try:
            stored = self.verdicts.get(sample_id)
        except StoreError as exc:
            log.warning("%s", exc)
            stored = None
        if stored is None:
            return found
        return {**stored, **(found or {})}

    # --- the uplink ----------------------------------------------------------------------

    def _on_connect(self) -> None:
        # Whatever was in flight when the link dropped may be lost: send it all again
        # (the cloud stores by sample_id, so a repeat is stored once).
        self.spool.reset_sent()
        self._uplink_backlogged = True
        self._check_due = True
        self._spooled.set()
        self._publish_status()

    def _begin_fresh(self) -> tuple[bool, list[str]]:
        """Before a writer batch commits: publish it directly? and the receipts to apply."""
        link = self.publisher
        direct = not self._uplink_backlogged and link.connected and link.backlog < 200
        with self._receipts_lock:
            if direct:
                self._publishing += 1
            acked, self._held_receipts = self._held_receipts, []
        return direct, acked

    def _end_fresh(
        self, published: bool, samples: list[NewSample], acked: list[str], removed: int | None
    ) -> None:
        """After a writer batch: publish it (committed, stored as sent) or leave it to the pump."""
        wake = False
        try:
            if published:
                for sample in samples:
                    self.publisher.publish(self.topic_samples, sample.payload, qos=1)
            elif samples:
                self._check_due = True
                wake = True
        finally:
            with self._receipts_lock:
                if removed is None:
                    self._held_receipts.extend(acked)  # the write failed: apply them later
                if published:
                    self._publishing -= 1
                wake = wake or bool(self._held_receipts)
        if removed is not None and acked:
            self.telemetry.receipted.inc(removed)
        if wake:
            self._spooled.set()

    def _pump_loop(self) -> None:
        resend = self.settings.resend_after_s
        checked = 0.0
        while not self._stopping.is_set():
            if self._spooled.wait(0.25):  # also wakes for resends after the timeout
                # Gather what else is spooled meanwhile: one read and one sent-mark for the
                # lot instead of a transaction pair per sample, for a few ms of delay.
                self._stopping.wait(self.settings.uplink_coalesce_ms / 1000.0)
            self._spooled.clear()
            # Read the spool when something unpublished was stored, after a reconnect, and
            # at least every 0.25 s for resends; a wake-up for receipts alone does not.
            check_due = self._check_due or time.monotonic() - checked >= 0.25
            self._check_due = False
            while not self._stopping.is_set():
                connected = self.publisher.connected
                if connected and check_due and self.publisher.backlog >= 200:
                    time.sleep(0.01)  # let the io thread drain its outbox first
                    continue
                due = []
                receipted: list[str] = []
                try:
                    if connected and check_due:
                        checked = time.monotonic()
                        due = self.spool.due(now=self.clock(), resend_after_s=resend, limit=100)
                    with self._receipts_lock:
                        self._publishing += 1
                    try:
                        for item in due:
                            self.publisher.publish(self.topic_samples, item.payload, qos=1)
                    finally:
                        with self._receipts_lock:
                            self._publishing -= 1
                            receipted, self._held_receipts = self._held_receipts, []
                    if due or receipted:
                        removed = self.spool.settle(
                            sent=[i.sample_id for i in due], acked=receipted, now=self.clock()
                        )
                        if receipted:
                            self.telemetry.receipted.inc(removed)
                except EdgeLoopError:
                    with self._receipts_lock:
                        self._held_receipts.extend(receipted)
                    log.exception("uplink pump failed; retrying")
                    break
                if len(due) < 100:
                    if connected and check_due:
                        self._uplink_backlogged = False
                    break

    def handle_message(self, topic: str, payload: bytes) -> None:
        """Receipts delete spooled samples; verdicts are matched to samples. Never raises."""
        try:
            if self.updater.handles(topic):
                self.updater.on_announcement(topic, payload)
            elif topic == self.topic_receipts:
                receipt = decode_message(payload, Receipt)
                with self._receipts_lock:
                    if self._publishing:  # applied with the next spool write, moments away
                        self._held_receipts.extend(receipt.sample_ids)
                        return
                removed = self.spool.ack(receipt.sample_ids)
                self.telemetry.receipted.inc(removed)
            elif topic == self.topic_verdicts:
                self._on_verdict(decode_message(payload, Verdict))
            else:
                log.debug("ignoring message on %s", topic)
        except MessageError as exc:
            kind = "receipt" if topic == self.topic_receipts else "verdict"
            self.telemetry.malformed.labels(kind, exc.reason).inc()
            log.warning("refused a %s message on %s: %s", kind, topic, exc)
        except EdgeLoopError as exc:
            log.error("could not handle a message on %s: %s", topic, exc)

    def _on_verdict(self, verdict: Verdict) -> None:
        self.telemetry.record_verdict(verdict.agrees_with_edge)
        data = verdict.model_dump(mode="json", by_alias=True)
        with self._results_lock:
            entry = self._results.setdefault(verdict.sample_id, {})
            entry["verdict"] = data
            result = entry.get("result")
        try:
            self.verdicts.put(verdict.sample_id, data, result, now=self.clock())
        except StoreError as exc:  # still answered from memory; only a restart would lose it
            log.warning("%s", exc)
        if self.settings.webhook_url:
            try:
                self._webhook_queue.put_nowait(data)
            except queue.Full:
                self.telemetry.webhook.labels("dropped").inc()
                log.warning("webhook queue full; verdict %s not posted", verdict.sample_id)

    def _webhook_loop(self) -> None:
        import httpx

        s = self.settings
        url = s.webhook_url
        assert url is not None
        counts = self.telemetry.webhook
        with httpx.Client(timeout=s.webhook_timeout_s) as client:
            while not self._stopping.is_set():
                try:
                    data = self._webhook_queue.get(timeout=0.5)
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
                    if self._stopping.wait(backoff.next_delay()):
                        break

    # --- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Everything the heartbeat, ``/v1/status`` and ``edge-agent status`` show."""
        spool = self.spool.stats()
        t = self.telemetry
        t.spool_depth.set(spool.depth)
        t.spool_bytes.set(spool.bytes)
        t.evicted.labels("audit").set(spool.evicted_audit)
        t.evicted.labels("oldest").set(spool.evicted_oldest)
        t.connected.set(int(self.publisher.connected))
        t.webhook_pending.set(self._webhook_queue.qsize())
        snap = t.snapshot()
        return {
            "fleet": self.settings.fleet,
            "agent": self.settings.agent_id,
            "ready": self.ready,
            "connected": self.publisher.connected,
            "uplink": self._uplink_status(),
            "model": {
                "name": self.engine.name,
                "version": self.engine.version,
                "provider": self.engine.provider,
                "labels": list(self.engine.labels),
                "input_hw": list(self.engine.input_hw),
            },
            "updates": self.updater.status(),
            "spool": asdict(spool),
            "spool_errors": self.spool_errors,
            "verdict_write_errors": self.verdicts.write_errors,
            "over_budget": self.router.over_budget,
            "sources": [src.status() for src in self._sources],
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            **snap,
        }

    def _uplink_status(self) -> dict[str, Any]:
        link_status = getattr(self.publisher, "status", None)
        if link_status is None:  # an in-memory publisher
            return {"connected": self.publisher.connected}
        return dict(link_status())

    def _publish_status(self) -> None:
        st = self.status()
        payload = _status_payload(
            self.settings,
            "online",
            model_version=st["model"]["version"],
            provider=st["model"]["provider"],
            frames_per_s=st["frames_per_s"],
            latency_p50_ms=st["latency_p50_ms"],
            latency_p99_ms=st["latency_p99_ms"],
            forward_rate=st["forward_rate"],
            spool_depth=st["spool"]["depth"],
            dropped_frames=st["dropped_frames"],
            agreement_rate=st["agreement_rate"],
            cpu_percent=st["cpu_percent"],
            memory_mb=st["memory_mb"],
            gpu=st["gpu"],
            model_name=st["model"]["name"],
            input_hw=st["model"]["input_hw"],
            runtime_version=runtime_version(),
            max_opset=self.settings.max_model_opset or max_supported_opset(),
        )
        self.publisher.publish(self.topic_status, payload, qos=1, retain=True)

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            if self.publisher.connected:
                try:
                    self._publish_status()
                except Exception:  # telemetry must never stop the agent
                    log.exception("heartbeat failed")


class _FreshSamples:
    """The spool writer's way to the link: a batch is published as soon as it commits."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def begin(self) -> tuple[bool, list[str]]:
        return self._agent._begin_fresh()

    def end(
        self, published: bool, samples: list[NewSample], acked: list[str], removed: int | None
    ) -> None:
        self._agent._end_fresh(published, samples, acked, removed)
