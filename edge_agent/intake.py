"""Frames in, answers out: decoding, micro-batching, routing, the answer for each frame.

Every source (the HTTP API, cameras, folders) hands frames to one
:class:`MicroBatcher` (``inference-loop``); each inferred batch is routed at once, on
its inference thread (on ``agent-post``, one hand-over per batch, when a single
inference thread feeds a GPU). Confident frames are answered there and
then; a forwarded frame is encoded and spooled by :class:`Forwarding` (on the
inference thread when several infer, else on ``agent-post``) and answered once its
sample is committed. Sources see only :class:`FrameSink`, the part of the agent
they send frames to.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, Protocol

import numpy as np

from edge_agent.batcher import DeferredFrame, JobBatch, MicroBatcher, WorkerPool
from edge_agent.engine import Engine
from edge_agent.forwarding import Forwarding
from edge_agent.imaging import (
    DecodedImage,
    ModelFrame,
    check_upload_cost,
    decode_for_model,
    decode_image,
    model_tensor,
    prepare_bgr,
    resize_for_model,
)
from edge_agent.routing import Decision, Router
from edge_agent.settings import AgentSettings
from edge_agent.spool import NewSample
from edge_agent.telemetry import Telemetry
from edge_agent.verdicts import RecentAnswers
from shared.decode_pool import DecodePool
from shared.ids import new_sample_id
from shared.images import ImageInfo
from shared.tasks import task_for

__all__ = ["FrameResult", "FrameSink", "FrameSource", "Intake", "Reply"]

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
    # A detector's answer (shared.tasks.detection): x1, y1, x2, y2 as fractions of the
    # frame, score, class; ``scores`` then holds a score per box.
    boxes: list[list[float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        # Flat fields only: cheaper than dataclasses.asdict's deep copy on the hot path.
        out = {name: getattr(self, name) for name in _RESULT_FIELDS}
        if out["boxes"] is None:
            del out["boxes"]  # a classifier's answer is what it always was
        return out


_RESULT_FIELDS = tuple(f.name for f in fields(FrameResult))

Reply = Callable[[FrameResult | None, BaseException | None], None]


class FrameSink(Protocol):
    """What a camera or folder source needs from the agent."""

    settings: AgentSettings
    telemetry: Telemetry

    def answer_bgr(
        self, bgr: np.ndarray, reply: Reply, *, source: str, block: bool = True
    ) -> None: ...

    def decode_for_model(self, body: bytes) -> ModelFrame: ...

    def answer_frame(
        self, frame: ModelFrame, reply: Reply, *, source: str, block: bool = True
    ) -> None: ...

    def process_upload(self, body: bytes, *, source: str = "http") -> FrameResult: ...

    def queue_undecoded(
        self, body: bytes, reply: Reply, *, source: str, block: bool = True
    ) -> bool: ...


class FrameSource(Protocol):
    """A source the agent starts and stops with itself (a camera, a folder)."""

    name: str

    def start(self) -> object: ...

    def stop(self, timeout: float = 5.0) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def health(self) -> dict[str, object]: ...


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
    """A Reply that settles a concurrent Future (what ``Intake.submit`` returns)."""

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


# A forwarded frame on its way to the spool: its job, output row, decision, sample id.
_Forwarded = tuple["_Job", np.ndarray, Decision, str]


class Intake:
    """Decodes, batches, infers and routes frames; answers each one (see module doc)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        engine: Engine,
        telemetry: Telemetry,
        forwarding: Forwarding,
        answers: RecentAnswers,
        decode_pool: DecodePool | None,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = telemetry
        self.forwarding = forwarding
        self.answers = answers
        self.decode_pool = decode_pool
        # The model's task says what its outputs mean and which routing rules apply;
        # a test double without one is a classifier.
        self.router = Router(
            settings.routing_policy,
            labels=list(engine.labels),
            clock=clock,
            rng=rng,
            task=task_for(getattr(engine, "task", None)),
        )
        self._router_lock = threading.Lock()  # Router keeps budget state

    def start(self) -> Intake:
        """Start ``inference-loop`` and the ``agent-post`` threads."""
        s = self.settings
        self.batcher = MicroBatcher(
            self.engine,
            max_batch=s.max_batch,
            max_wait_s=s.max_wait_ms / 1000.0,
            on_batch=self._on_batch,
            threads=s.inference_threads,
            pin=s.pin_inference_threads,
        ).start()
        self._post = WorkerPool(2, name="agent-post")
        return self

    def stop(self) -> None:
        """Answer what is queued or in flight (frames forwarded meanwhile still spool)."""
        self.batcher.stop()
        self._post.shutdown(wait=True)

    def swap_engine(self, engine: Engine) -> None:
        """Serve from ``engine`` from the next batch on (the batch in flight ends on the old)."""
        self.batcher.swap_engine(engine)
        self.engine = engine

    # --- decoding --------------------------------------------------------------------

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

    # --- frames in -------------------------------------------------------------------

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
        outer: Future[FrameResult] = Future()
        self.answer_bgr(bgr, _FutureReply(outer), source=source, block=block)
        return outer

    def answer_bgr(self, bgr: np.ndarray, reply: Reply, *, source: str, block: bool = True) -> None:
        """Queue one BGR frame as OpenCV captures it; ``reply(result, error)`` answers it
        (as ``answer_frame`` does: no future per frame). Raises queue.Full or ModelError
        when the frame cannot be queued at all."""
        started = time.perf_counter()
        tensor = prepare_bgr(bgr, self.engine.input_hw)
        job = _Job(bgr, True, source, None, None, started, reply)
        self.batcher.submit_job(tensor, job, block=block)

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

    @property
    def decodes_uploads_inline(self) -> bool:
        """Whether uploads are decoded by the inference thread that takes their batch.

        With several inference threads each keeps a core busy, decoding its batch and
        then inferring it, and a frame is handed over once (into the batch) instead of
        through a decode thread as well. The reference detector behind HTTP (two
        inference threads, ``python -m bench.ab agent``, two runs): 684 and 644 frames/s
        decoding here against 656 and 594 through decode threads, 2.300 and 2.383 ms of
        CPU a frame against 2.367 and 2.525. With one inference thread (a GPU, or ORT's
        threads on every core) decode threads overlap its batches.
        """
        return self.settings.inference_threads > 1

    def queue_undecoded(
        self, body: bytes, reply: Reply, *, source: str, block: bool = True
    ) -> bool:
        """Queue an upload (a JPEG or PNG) as it is, for the inference thread that takes
        it to decode into its batch, where several inference threads decode their own
        (``decodes_uploads_inline``) and its decode needs no isolation; whether it did
        (False: decode it first, ``decode_for_model``, then ``answer_frame``).

        Its limits are checked here, from its header: raises ImageRejected, and, as
        ``answer_frame`` does, queue.Full or ModelError when it cannot be queued.
        """
        if not self.decodes_uploads_inline:
            return False
        started = time.perf_counter()
        info, cost = check_upload_cost(
            body, max_bytes=self.settings.max_image_bytes, max_pixels=self.settings.max_pixels
        )
        if self.decode_pool is not None and self.decode_pool.isolates(cost):
            return False
        job = _Job(None, False, source, body, info, started, reply)
        frame = DeferredFrame(functools.partial(model_tensor, body, info))
        self.batcher.submit_job(frame, job, block=block)
        return True

    def _submit(
        self,
        tensor: np.ndarray,
        rgb: np.ndarray | None,
        source: str,
        encoded: bytes | None,
        info: ImageInfo | None,
        started: float,
        block: bool,
    ) -> Future[FrameResult]:
        outer: Future[FrameResult] = Future()
        job = _Job(rgb, False, source, encoded, info, started, _FutureReply(outer))
        self.batcher.submit_job(tensor, job, block=block)
        return outer

    # --- answers out -----------------------------------------------------------------

    def _on_batch(self, batch: JobBatch) -> None:
        # On an inference thread, which routes and answers its own batch: on a CPU the
        # cores are what inference, decoding and routing share, and handing a batch to
        # another thread only adds a wake-up (the reference detector behind HTTP with
        # several inference threads, alternating pairs: 2.11-2.29 ms per frame routed
        # here against 2.25-2.36 handed over; with one inference thread on both cores,
        # `python -m bench.ab agent --layout 0,1`: video 1298 against 1201 frames/s, HTTP
        # 1018 against 992). With one inference thread on a GPU, the batch is handed
        # over, so the device gets its next batch at once.
        # Forwarded frames are encoded and committed here too when several threads
        # infer (another infers meanwhile, and each hand-over cost more than the work:
        # the detector behind HTTP, `python -m bench.ab agent`, encoding here 2.425
        # against 2.350 ms and 733 against 756 frames/s, then committing here too 2.533
        # against 2.458 ms, 702 against 717 frames/s; on video no clear change); with
        # one, on agent-post through the spool writer, so the next batch starts at once.
        jobs: list[_Job] = batch.jobs
        if batch.error is not None:
            _fail_all(jobs, batch.error)
            return
        self.forwarding.expect(len(jobs))
        if self.settings.inference_threads > 1 or batch.engine.provider == "cpu":
            self._finish_batch(batch, on_inference_thread=True)
            return
        try:
            self._post.submit(self._finish_batch, batch)
        except RuntimeError as exc:  # the pool is shut down: the agent is stopping
            self.forwarding.routed(len(jobs))
            _fail_all(jobs, exc)

    def _finish_batch(self, batch: JobBatch, *, on_inference_thread: bool = False) -> None:
        """Route one inferred batch and answer it: confident frames at once, forwarded
        ones once their samples are spooled (encoded after the others are answered; on
        agent-post when this runs on the only inference thread)."""
        jobs: list[_Job] = batch.jobs
        forwarding = 0  # forwarded frames _forward_all counts as routed
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
            forwarded: list[_Forwarded] = []
            for job, row, decision in zip(jobs, scores, decisions, strict=True):
                if decision.over_budget:
                    self.telemetry.over_budget.inc()
                sample_id = new_sample_id()
                if decision.forward:
                    forwarded.append((job, row, decision, sample_id))
                    continue
                try:
                    answer = self.router.task.sample_fields(row)
                    answered.append((job, self._result(job, answer, batch, decision, sample_id)))
                except BaseException as exc:
                    job.reply(None, exc)
            self._deliver(answered)
            forwarding = len(forwarded)
            if forwarded and on_inference_thread and self.settings.inference_threads == 1:
                try:
                    self._post.submit(self._forward_all, forwarded, batch)
                    return
                except RuntimeError:  # the pool is shut down: the agent is stopping
                    pass
            if forwarded:
                self._forward_all(forwarded, batch, commit_here=on_inference_thread)
        finally:
            self.forwarding.routed(len(jobs) - forwarding)

    def _forward_all(
        self, forwarded: list[_Forwarded], batch: JobBatch, *, commit_here: bool = False
    ) -> None:
        """Spool a batch's forwarded frames (one transaction on this thread when
        ``commit_here``, else through the spool writer), then count them as routed."""
        try:
            samples: list[tuple[NewSample, Callable[[bool], None]]] = []
            for job, row, decision, sample_id in forwarded:
                entry = self._forward(job, row, batch, decision, sample_id)
                if entry is not None:
                    samples.append(entry)
            if samples:
                self.forwarding.store(samples, here=commit_here)
        finally:
            self.forwarding.routed(len(forwarded))

    def _forward(
        self, job: _Job, row: np.ndarray, batch: JobBatch, decision: Decision, sample_id: str
    ) -> tuple[NewSample, Callable[[bool], None]] | None:
        """A forwarded frame's sample and what answers it once stored (unforwarded when
        that fails); None when it could not be made (the frame is answered here)."""
        answer = self.router.task.sample_fields(row)  # once, for the header and the reply
        try:
            sample = self.forwarding.encode_sample(
                sample_id,
                decision,
                answer,
                batch.engine,
                job.frame,
                job.bgr,
                job.encoded,
                job.info,
                job.captured_at,
                job.source,
                decode=self.decode,
            )
            if sample is None:
                self._deliver([(job, self._result(job, answer, batch, decision, sample_id))])
                return None
        except BaseException as exc:
            job.reply(None, exc)
            return None

        def stored(ok: bool) -> None:
            try:
                result = self._result(job, answer, batch, decision, sample_id, forwarded=ok)
            except BaseException as exc:
                job.reply(None, exc)
            else:
                self._deliver([(job, result)])

        return sample, stored

    def _result(
        self,
        job: _Job,
        answer: Mapping[str, Any],  # the task's sample-header fields of the frame's output
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
            scores=answer["scores"],
            boxes=answer.get("boxes"),
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
            self.answers.remember([(r.sample_id, r.as_dict()) for _, r in answered])
        except BaseException as exc:
            for job, _ in answered:
                job.reply(None, exc)
            return
        for job, result in answered:
            job.reply(result, None)
