"""The Agent: frames in, answers out at once, unsure frames to the spool and the cloud.

    with Agent(settings, engine=engine, publisher=link, clock=time.time) as agent:
        result = agent.process(rgb, source="http")

The agent wires its parts and starts them in order; stopping ends them in reverse.
Their named background threads:

- ``inference-loop``  (:mod:`edge_agent.intake`) batches frames across sources and runs
                      the student (``inference_threads`` > 1: ``inference-loop-1`` ...
                      too, each with a batch of its own)
- ``agent-post-*``    with one inference thread, encodes and spools each batch's
                      forwarded frames, and when that thread feeds a GPU also routes
                      each inferred batch (one hand-over per batch) and answers its
                      confident frames; several inference threads do all of it for
                      their own batches
- ``spool-writer``    (:mod:`edge_agent.spool_writer`) stores forwarded samples a
                      micro-batch at a time (one transaction; several inference threads
                      store their own batch's the same way); a forwarded frame is
                      answered once its sample is committed, and the batch is published
                      right after, while the link keeps up
- ``uplink-pump``     publishes what is due in the spool (samples stored while the link
                      was down or backed up, resends) and applies held receipts
- ``heartbeat-loop``  (:mod:`edge_agent.status`) publishes the retained AgentStatus every
                      ``heartbeat_s``
- ``mqtt-io``         (MqttLink) the one thread that touches paho
- ``webhook-loop``    (:mod:`edge_agent.verdicts`) posts verdicts to the user's
                      application, when configured (a bounded queue, retries with
                      jittered backoff; inference never waits for it)
- ``verdict-writer``  stores verdicts (``VerdictStore``, the newest ``verdicts_kept``), so
                      ``GET /v1/samples/{id}`` still shows them after a restart
- ``model-updater``   (ModelUpdater) verifies, downloads and swaps in announced models
- one thread per camera and folder source

Every I/O edge is a constructor argument (engine, publisher, clock), so tests swap
the expensive ones for doubles and keep the cheap real ones (SQLite, Mosquitto).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from edge_agent.engine import Engine, EngineOptions, OrtEngine
from edge_agent.forwarding import Forwarding
from edge_agent.imaging import DecodedImage, ModelFrame, opencv_threads
from edge_agent.intake import FrameResult, FrameSource, Intake, Reply
from edge_agent.settings import AgentSettings
from edge_agent.sources.camera import CameraReader
from edge_agent.sources.folder import FolderWatcher
from edge_agent.status import StatusReporter, status_payload
from edge_agent.telemetry import Telemetry
from edge_agent.updates import ModelUpdater, active_model_path
from edge_agent.uplink import MqttLink, Publisher
from edge_agent.verdicts import VerdictKeeper, VerdictStore
from shared.decode_pool import DecodePool
from shared.errors import EdgeLoopError, MessageError
from shared.images import ImageInfo
from shared.interpreter import switch_interval, young_collections
from shared.lifecycle import WorkerHealth
from shared.messages import Receipt, decode_message, decode_verdicts

__all__ = ["Agent", "FrameResult", "Reply", "VerdictStore", "build_engine", "build_publisher"]

log = logging.getLogger(__name__)


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
        will=(topics.status(fleet, agent), status_payload(settings, "offline")),
        protocol=None if settings.mqtt_protocol == "auto" else settings.mqtt_protocol,
        keepalive_s=settings.mqtt_keepalive_s,
        backoff_min_s=settings.reconnect_min_s,
        backoff_max_s=settings.reconnect_max_s,
        ca_file=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None,
    )


class Agent:
    """One edge agent; a context manager that owns its parts and their threads."""

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
        self._sources: list[FrameSource] = []
        self.ready = False
        self.started_at = time.monotonic()
        self._switch_interval = switch_interval(settings.switch_interval_ms)
        self._collections = young_collections(settings.gc_young_every)
        self._opencv_threads = opencv_threads(settings.opencv_threads)
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
        engine: Engine = self._engine_arg or build_engine(s, active_model_path(s))
        self.publisher: Publisher = self._publisher_arg or build_publisher(s)
        self.forwarding = Forwarding(
            s, publisher=self.publisher, telemetry=self.telemetry, clock=self.clock
        ).start()
        self.spool = self.forwarding.spool
        self.spool_writer = self.forwarding.spool_writer
        self.verdicts = VerdictStore(
            s.resolved_verdicts_path, keep=s.verdicts_kept, moved_from=s.resolved_spool_path
        )
        self.verdict_keeper = VerdictKeeper(
            s, store=self.verdicts, telemetry=self.telemetry, clock=self.clock, rng=self._rng
        )
        self.intake = Intake(
            s,
            engine=engine,
            telemetry=self.telemetry,
            forwarding=self.forwarding,
            answers=self.verdict_keeper.answers,
            decode_pool=self.decode_pool,
            clock=self.clock,
            rng=self._rng,
        ).start()
        self.router = self.intake.router
        self.batcher = self.intake.batcher
        self.updater = ModelUpdater(
            s,
            publish=lambda topic, payload: self.publisher.publish(topic, payload, qos=1),
            current=lambda: self.engine,
            swap=self.swap_engine,
            engine_factory=lambda path: build_engine(s, path),
            transport=self._model_transport,
        ).start()
        self.status_reporter = StatusReporter(
            s,
            telemetry=self.telemetry,
            publisher=self.publisher,
            intake=self.intake,
            forwarding=self.forwarding,
            verdicts=self.verdict_keeper,
            updater=self.updater,
            sources=self._sources,
            ready=lambda: self.ready,
            started_at=self.started_at,
        )
        self.publisher.set_handlers(on_message=self.handle_message, on_connect=self._on_connect)
        self.publisher.start()
        self.status_reporter.start()
        self.verdict_keeper.start()
        # The HTTP event loop and the MQTT thread give the GIL up on every socket call,
        # the decoders on every decode; a shorter interval hands it back to them sooner.
        self._switch_interval.apply()
        self._opencv_threads.apply()
        # A frame's path allocates hundreds of short-lived objects, hardly any cyclic:
        # collected rarely, and what the agent holds once started (the model) frozen.
        self._collections.apply()
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
        # A batch for each inference thread; a video file two more, so its reader
        # prepares the next batches while those are inferred even when two inference
        # threads finish at once, or a forwarded frame holds its slot until its sample
        # is committed (with one more, the detector's clip ran 836 against 865 frames/s:
        # `python -m bench.ab agent --source video`). A live camera keeps no more, to
        # answer fresh frames.
        batch = max(1, self.settings.max_batch)
        batches = batch * self.settings.inference_threads
        for camera in self.settings.cameras:
            live = not Path(camera.uri).is_file()
            inflight = batches if live else batches + 2 * batch
            self._sources.append(CameraReader(camera, self, max_inflight=inflight).start())
        for folder in self.settings.folders:
            self._sources.append(FolderWatcher(folder, self).start())

    def stop(self) -> None:
        self.ready = False
        for source in self._sources:
            source.stop()
        self.status_reporter.stop()
        self.verdict_keeper.stop()
        self.updater.stop()
        self.intake.stop()
        self.forwarding.stop()  # stores (and answers) what is still queued
        self.status_reporter.publish_offline()
        self.publisher.stop()
        self.forwarding.close()
        self.verdict_keeper.close()
        if self.decode_pool is not None:
            self.decode_pool.close()
        self._switch_interval.restore()
        self._opencv_threads.restore()
        self._collections.restore()

    def health(self) -> dict[str, object]:
        """Each part's threads: alive, iterations, errors and the last error, by part."""
        parts: dict[str, dict[str, object]] = {
            "forwarding": self.forwarding.health(),
            "verdicts": self.verdict_keeper.health(),
            "status": self.status_reporter.health(),
            "updater": self.updater.health(),
        }
        for source in self._sources:
            parts[f"source:{source.name}"] = source.health()
        threads = {
            part: {
                name: asdict(state) if isinstance(state, WorkerHealth) else state
                for name, state in workers.items()
            }
            for part, workers in parts.items()
        }
        alive = all(
            state.alive
            for workers in parts.values()
            for state in workers.values()
            if isinstance(state, WorkerHealth)
        )
        return {"ready": self.ready, "alive": self.ready and alive, "parts": threads}

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def engine(self) -> Engine:
        """The engine serving now."""
        return self.intake.engine

    def swap_engine(self, engine: Engine) -> None:
        """Serve from ``engine`` from the next batch on (the batch in flight ends on the old)."""
        self.intake.swap_engine(engine)

    # --- frames ------------------------------------------------------------------------

    def decode(self, body: bytes) -> DecodedImage:
        """Check and decode an upload (raises ImageRejected naming what is accepted)."""
        return self.intake.decode(body)

    def decode_for_model(self, body: bytes) -> ModelFrame:
        """Check an upload and decode it straight to the model's input (raises ImageRejected)."""
        return self.intake.decode_for_model(body)

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
        return self.intake.submit(rgb, source=source, encoded=encoded, info=info, block=block)

    def submit_bgr(
        self, bgr: np.ndarray, *, source: str, block: bool = True
    ) -> Future[FrameResult]:
        """Queue one BGR frame as OpenCV captures it (resized first, then converted to RGB)."""
        return self.intake.submit_bgr(bgr, source=source, block=block)

    def answer_bgr(self, bgr: np.ndarray, reply: Reply, *, source: str, block: bool = True) -> None:
        """Queue one BGR frame; ``reply(result, error)`` answers it on an agent thread."""
        self.intake.answer_bgr(bgr, reply, source=source, block=block)

    def submit_frame(
        self, frame: ModelFrame, *, source: str, block: bool = True
    ) -> Future[FrameResult]:
        """Queue an upload already decoded at the model's size (``decode_for_model``)."""
        return self.intake.submit_frame(frame, source=source, block=block)

    def answer_frame(
        self, frame: ModelFrame, reply: Reply, *, source: str, block: bool = True
    ) -> None:
        """Queue an upload decoded at the model's size; ``reply(result, error)`` answers it.

        The reply runs once, on an agent thread, with a FrameResult or the error that
        stopped the frame; a batch's frames are answered together, so a reply should
        only hand the answer on. Raises queue.Full or ModelError when the frame cannot
        be queued at all.
        """
        self.intake.answer_frame(frame, reply, source=source, block=block)

    @property
    def decodes_uploads_inline(self) -> bool:
        return self.intake.decodes_uploads_inline

    def queue_undecoded(
        self, body: bytes, reply: Reply, *, source: str, block: bool = True
    ) -> bool:
        """Queue an upload for the inference thread that takes it to decode, where the
        agent decodes its uploads so; whether it did (``Intake.queue_undecoded``)."""
        return self.intake.queue_undecoded(body, reply, source=source, block=block)

    def process(self, rgb: np.ndarray, *, source: str, **kwargs: Any) -> FrameResult:
        """Answer one frame (blocking)."""
        return self.submit(rgb, source=source, **kwargs).result(self.settings.infer_timeout_s)

    def process_upload(self, body: bytes, *, source: str = "http") -> FrameResult:
        """Decode and answer one uploaded JPEG/PNG (blocking)."""
        frame = self.decode_for_model(body)
        return self.submit_frame(frame, source=source).result(self.settings.infer_timeout_s)

    def sample(self, sample_id: str) -> dict[str, Any] | None:
        """The answer and (when it has arrived) the teacher's verdict for a sample id."""
        return self.verdict_keeper.sample(sample_id)

    # --- the uplink ----------------------------------------------------------------------

    def _on_connect(self) -> None:
        self.forwarding.on_connect()
        self._publish_status()

    def handle_message(self, topic: str, payload: bytes) -> None:
        """Receipts delete spooled samples; verdicts are matched to samples. Never raises."""
        try:
            if self.updater.handles(topic):
                self.updater.on_announcement(topic, payload)
            elif topic == self.topic_receipts:
                self.forwarding.on_receipt(decode_message(payload, Receipt))
            elif topic == self.topic_verdicts:
                self.verdict_keeper.on_verdicts(decode_verdicts(payload))
            else:
                log.debug("ignoring message on %s", topic)
        except MessageError as exc:
            kind = "receipt" if topic == self.topic_receipts else "verdict"
            self.telemetry.malformed.labels(kind, exc.reason).inc()
            log.warning("refused a %s message on %s: %s", kind, topic, exc)
        except EdgeLoopError as exc:
            log.error("could not handle a message on %s: %s", topic, exc)

    # --- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Everything the heartbeat, ``/v1/status`` and ``edge-agent status`` show."""
        return self.status_reporter.status()

    def _publish_status(self) -> None:
        self.status_reporter.publish()
