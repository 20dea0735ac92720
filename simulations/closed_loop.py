"""The closed loop, measured: drift hits the fleet, a trigger fires, a distillation round
runs, the new student reaches the agents, and accuracy recovers; then the drifted stream
goes on, the trigger fires again, and further rounds run until the loop settles.

    edgeloop loop [--quick] [--json] [--drift blur:0.8] [--agents 3] [--rounds 2]
                  [--report loop.html]

On embedded defaults, in one process tree: an embedded MQTT broker; SQLite and a
local blob folder in a temporary data dir; the cloud verifier
(``cloud_service.worker``: MQTT ingest, teacher batching, receipts, verdicts); the
cloud's REST API over HTTP (``cloud_service.api``) serving signed model artifacts;
the model registry with signed, retained announcements over MQTT; a distill worker
(``distill.worker`` + ``distill.pipeline``) claiming the job the drift trigger queues;
and ``agents`` real edge agents (``edge_agent.Agent``), each enrolled with its own
API token and fed by its own camera stream in its own thread. An agent answers
every frame with its INT8 student, spools and forwards the unsure frames (plus an
audit share) over MQTT, receives verdicts, and installs new models as it does in
the field: retained announcement, signature, HTTP download, sha256, golden inputs,
atomic swap.

Frames come from the reference scenario's stream split (each scan rendered
``stream_renders`` times, 16 by default: about 1,400 distinct frames per pool; the
stream is never trained on, so the render count changes no model), divided by
source scan into two pools that share no scan: the *live* pool feeds the clean and
drifted phases (whose forwarded frames become the round's training data) and the
*evaluation* pool is used for every figure in the table, so "after" is measured on
frames the new student never trained on. The table's columns use the same evaluation frames (same
seeds): ``before drift`` (serving student, clean), ``drifted`` (serving student,
drifted) and ``after round k`` for each round (that round's student, drifted; the clean
frames again for forgetting). The serving-student columns, and every round's column but
the last, apply each agent's routing rule without sending (the verdict would be the
teacher's answer on the same bytes); the last round's column is live through the fleet.
So no evaluation frame is ever verified, and none can reach a round's training data.

Rounds: round 1 trains on what the trigger's first firing found (the newest verified
samples, up to ``max_samples``). From round 2 on, the drifted stream continues on the
live pool with the previous round's student serving; the same drift trigger, with the
same conditions, is ticked on what the agents have forwarded, and round k's job takes
the newest verified samples (the resumed stream's first, then earlier ones, up to
``max_samples``) plus its replay of the reference training set, warm-started from the
serving student. The goals read two columns: the first-round goals (recovery, gap
closed, forgetting, forward-rate drop) read ``after round 1``; the steady-state goals
(hybrid accuracy, forward rate, uplink) read the last round.

Agents run with their own defaults except the forwarding threshold (``threshold``)
and the connection details; in particular they keep the agent's default audit share.
The run is not bit-for-bit repeatable: agents answer concurrently, so which verified
samples are newest (and so which ones the round trains on) varies a little.

What stays simplified: the agents run in this process (a thread each, not a process
per device), and the camera streams run as fast as the agents answer.
"""

from __future__ import annotations

import html
import io
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from distill.frames import FrameSet
from edge_agent.agent import Agent, FrameResult
from edge_agent.imaging import encode_for_upload
from edge_agent.routing import Router
from edge_agent.settings import AgentSettings
from shared.errors import MessageError
from shared.ids import new_sample_id
from shared.messages import Verdict, decode_message
from shared.settings import EdgeLoopSettings

__all__ = [
    "LoopProgress",
    "PhaseStats",
    "goal_columns",
    "run_closed_loop",
    "split_pool",
    "table_header",
    "table_rows",
]

FLEET = "demo"
MODEL = "edgeloop-student"
DISAGREEMENT_BOUND = 0.2  # the drift trigger: teacher disagreement over the window
VERDICT_WAIT_S = 60.0
# Stream seeds of the evaluation phases: "before" and "after" see the very same frames.
EVAL_DRIFT_SEED, EVAL_CLEAN_SEED = 6, 7


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def split_pool(pool: FrameSet, seed: int = 0) -> tuple[FrameSet, FrameSet]:
    """(live, evaluation): the pool's frames divided by source scan, so no scan is in both."""
    if pool.sources is None:
        raise ValueError("the stream pool carries no source ids to split by")
    scans = np.unique(pool.sources)
    rng = np.random.default_rng([seed, 31337])
    live_scans = rng.permutation(scans)[: len(scans) // 2]
    live = np.isin(pool.sources, live_scans)
    return pool.subset(np.flatnonzero(live)), pool.subset(np.flatnonzero(~live))


# ---------------------------------------------------------------------------------
# What a phase saw


@dataclass
class PhaseStats:
    frames: int = 0
    edge_correct: int = 0
    forwarded: int = 0
    hybrid_correct: int = 0
    teacher_correct: int = 0
    bytes_sent: int = 0
    bytes_all: int = 0
    verdicts: int = 0
    verdicts_missing: int = 0
    edge_ms: list[float] = field(default_factory=list)
    verdict_ms: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        n = max(1, self.frames)

        def p50(values: list[float]) -> float | None:
            return round(statistics.median(values), 2) if values else None

        return {
            "frames": self.frames,
            "edge_accuracy": self.edge_correct / n,
            "forward_rate": self.forwarded / n,
            "hybrid_accuracy": self.hybrid_correct / n,
            "teacher_only_accuracy": self.teacher_correct / n,
            "uplink_bytes": self.bytes_sent,
            "uplink_all_frames_bytes": self.bytes_all,
            "uplink_share": self.bytes_sent / max(1, self.bytes_all),
            "verdicts": self.verdicts,
            "verdicts_missing": self.verdicts_missing,
            "edge_latency_p50_ms": p50(self.edge_ms),
            "capture_to_verdict_p50_ms": p50(self.verdict_ms),
        }


@dataclass
class _Pending:
    label: int  # ground truth
    sent: float  # perf_counter when the agent answered
    n: int  # the frame's position on the timeline


class _Timeline:
    """Everything the report plots. ``n`` is a live frame's position in the fleet's
    stream (frames in the order the agents answered them), ``t`` seconds since the
    loop started; the measuring passes send nothing and are not on it."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.lock = threading.Lock()
        # row n: (t, phase, agent, version, edge correct, forwarded, edge latency ms)
        self.frames: list[tuple[float, str, str, str, int, int, float]] = []
        self.verdicts: list[tuple[int, float, float]] = []  # (n sent, t arrived, latency ms)
        self.versions: list[tuple[int, str, str]] = []  # (n, agent, version first served)
        self.spans: list[tuple[str, int, int, float, float]] = []  # (name, n0, n1, t0, t1)
        self.marks: list[tuple[int, str]] = []  # (n, what happened)

    def now(self) -> float:
        return round(time.perf_counter() - self.start, 3)

    def mark(self, text: str) -> None:
        with self.lock:
            self.marks.append((len(self.frames), text))

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "frames": list(self.frames),
                "verdicts": list(self.verdicts),
                "versions": list(self.versions),
                "spans": list(self.spans),
                "marks": list(self.marks),
            }


class _LoopAgent(Agent):
    """A real edge agent that also notes when each verdict arrives (latency and hybrid)."""

    def __init__(self, settings: AgentSettings, *, loop: _Fleet, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        self.loop = loop

    def handle_message(self, topic: str, payload: bytes) -> None:
        super().handle_message(topic, payload)
        if topic != self.topic_verdicts:
            return
        try:
            verdict = decode_message(payload, Verdict)
        except MessageError:
            return  # the agent itself has counted and logged the refusal
        self.loop.on_verdict(verdict.sample_id, verdict.label, time.perf_counter())


# ---------------------------------------------------------------------------------
# Live progress


class LoopProgress:
    """Live progress in the terminal: a bar per phase with running figures, the job's steps."""

    def __init__(self, console: Console, *, live: bool = True) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not live,
            transient=False,
        )
        self.live = live
        self._job_task: TaskID | None = None

    def __enter__(self) -> LoopProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def note(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)

    def phase(self, name: str, total: int) -> TaskID:
        return self.progress.add_task(name, total=total, status="")

    def advance(self, task: TaskID, status: str) -> None:
        self.progress.update(task, advance=1, status=status)

    def job(self, job_id: int, phase: str, percent: float) -> None:
        if self._job_task is None:
            self._job_task = self.progress.add_task(f"distill job {job_id}", total=100, status="")
        self.progress.update(self._job_task, completed=percent, status=phase)


# ---------------------------------------------------------------------------------
# The fleet


class _Fleet:
    """The agents, their streams, and the bookkeeping that turns answers into figures."""

    def __init__(
        self,
        agents: list[_LoopAgent],
        teacher: ort.InferenceSession,
        timeline: _Timeline,
        progress: LoopProgress,
        frames: int,
    ) -> None:
        self.agents = agents
        self.teacher = teacher
        self.timeline = timeline
        self.progress = progress
        self.frames = frames
        self.lock = threading.Lock()
        self.pending: dict[str, _Pending] = {}
        self.answered: dict[str, tuple[int, float]] = {}  # sample id -> (verdict label, t)
        self.last_version: dict[str, str] = {}

    def on_verdict(self, sample_id: str, label: int, at: float) -> None:
        with self.lock:
            self.answered[sample_id] = (label, at)

    def _uplink(self, agent: Agent, frame: np.ndarray, result: FrameResult) -> tuple[bytes, int]:
        """(image bytes, envelope bytes) of this frame as the agent's uplink encodes it."""
        s = agent.settings
        image, info = encode_for_upload(
            frame,
            original=None,
            original_info=None,
            max_side=s.upload_max_side,
            quality=s.upload_jpeg_quality,
            recompress=s.upload_recompress,
        )
        envelope = agent.envelope(
            sample_id=result.sample_id,
            image=image,
            image_info=info,
            captured_at=datetime.now(UTC),
            model_name=result.model_name,
            model_version=result.model_version,
            scores=result.scores,
            predicted=result.predicted,
            confidence=result.confidence,
            route_reason=result.route_reason or "audit",
            priority=result.priority,
            source="stream",
        )
        return image, len(envelope)

    def _teacher_label(self, image: bytes) -> int:
        with Image.open(io.BytesIO(image)) as img:
            pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
        return int(np.argmax(self.teacher.run(None, {"frames": pixels[None]})[0][0]))

    def run_phase(
        self,
        name: str,
        pool: FrameSet,
        drift: tuple[Any, ...],
        seed: int,
        *,
        live: bool,
    ) -> dict[str, Any]:
        """Stream ``frames`` frames to every agent; ``live=False`` measures without sending."""
        from distill.drift import DriftSchedule, FrameStream

        stats = PhaseStats()
        task = self.progress.phase(name, self.frames * len(self.agents))
        t0, n0 = self.timeline.now(), len(self.timeline.frames)
        forwarded_ids: list[str] = []

        def status() -> str:
            n = max(1, stats.frames)
            return f"edge {stats.edge_correct / n:6.1%}  forward {stats.forwarded / n:6.1%}"

        def work(index: int, agent: _LoopAgent) -> None:
            stream = FrameStream(
                pool,
                drift=drift,
                schedule=DriftSchedule("abrupt", 0),
                limit=self.frames,
                seed=seed * 100 + index,
            )
            # Measuring without sending: the agent's own routing policy, its own draws.
            router = Router(
                agent.settings.routing_policy,
                labels=list(agent.engine.labels),
                clock=time.time,
                rng=random.Random(seed * 1000 + index),
            )
            for item in stream:
                if live:
                    result = agent.process(item.frame, source="stream")
                    forwarded, edge_ms = result.forwarded, result.latency_ms
                else:
                    started = time.perf_counter()
                    scores = np.asarray(agent.engine.run(item.frame[None])[0])
                    edge_ms = (time.perf_counter() - started) * 1e3
                    decision = router.decide(scores)
                    result = FrameResult(
                        sample_id=new_sample_id(),
                        label=str(decision.predicted),
                        predicted=decision.predicted,
                        scores=[float(x) for x in scores],
                        confidence=decision.confidence,
                        forwarded=decision.forward,
                        route_reason=decision.reason,
                        priority=decision.priority,
                        over_budget=decision.over_budget,
                        latency_ms=edge_ms,
                        model_name=agent.engine.name,
                        model_version=agent.engine.version,
                        source="stream",
                    )
                    forwarded = decision.forward
                image, size = self._uplink(agent, item.frame, result)
                teacher = self._teacher_label(image)
                correct = int(result.predicted == item.label)
                with self.lock:
                    stats.frames += 1
                    stats.edge_correct += correct
                    stats.teacher_correct += int(teacher == item.label)
                    stats.bytes_all += size
                    stats.edge_ms.append(edge_ms)
                    if forwarded:
                        stats.forwarded += 1
                        stats.bytes_sent += size
                        if live:
                            self.pending[result.sample_id] = _Pending(
                                item.label, time.perf_counter(), len(self.timeline.frames)
                            )
                            forwarded_ids.append(result.sample_id)
                        else:  # the verdict would be the teacher's answer on these bytes
                            stats.hybrid_correct += int(teacher == item.label)
                    else:
                        stats.hybrid_correct += correct
                    if live:
                        t, n = self.timeline.now(), len(self.timeline.frames)
                        version = result.model_version
                        self.timeline.frames.append(
                            (
                                t,
                                name,
                                agent.settings.agent_id,
                                version,
                                correct,
                                int(forwarded),
                                round(edge_ms, 3),
                            )
                        )
                        if self.last_version.get(agent.settings.agent_id) != version:
                            self.last_version[agent.settings.agent_id] = version
                            self.timeline.versions.append((n, agent.settings.agent_id, version))
                    line = status()
                self.progress.advance(task, line)

        errors: list[BaseException] = []

        def guarded(index: int, agent: _LoopAgent) -> None:
            try:
                work(index, agent)
            except BaseException as exc:  # surfaced in the caller's thread below
                errors.append(exc)

        threads = [
            threading.Thread(target=guarded, args=(i, a), name=f"stream-{a.settings.agent_id}")
            for i, a in enumerate(self.agents)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"phase {name!r}: a stream failed: {errors[0]!r}") from errors[0]
        if live:
            self._settle(forwarded_ids, stats)
        if live:
            with self.timeline.lock:
                n1 = len(self.timeline.frames)
                self.timeline.spans.append((name, n0, n1, t0, self.timeline.now()))
        row = stats.row()
        row["live"] = live
        return row

    def _settle(self, ids: list[str], stats: PhaseStats) -> None:
        """Wait for the verdicts of a live phase's forwarded frames; the hybrid answer is theirs."""
        deadline = time.monotonic() + VERDICT_WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                if all(i in self.answered for i in ids):
                    break
            time.sleep(0.05)
        with self.lock:
            for sid in ids:
                pending = self.pending.pop(sid)
                got = self.answered.get(sid)
                if got is None:
                    # No verdict in time: the edge answer stands.
                    stats.verdicts_missing += 1
                    continue
                label, at = got
                stats.verdicts += 1
                stats.hybrid_correct += int(label == pending.label)
                latency = (at - pending.sent) * 1e3
                stats.verdict_ms.append(latency)
                self.timeline.verdicts.append(
                    (pending.n, round(at - self.timeline.start, 3), latency)
                )


# ---------------------------------------------------------------------------------
# The run


def _models(quick: bool, console: Console) -> Any:
    from distill.cache import ReferenceConfig, bootstrap_reference_models, default_cache_dir

    cache = default_cache_dir()
    if not quick:
        cfg = ReferenceConfig.reference()
        have = (cache / f"student-{cfg.student_key()}" / "student.int8.onnx").is_file()
        if not have:
            console.print(
                "[yellow]the full reference student is not cached under its current key;"
                " training it now (minutes)[/]"
            )
    return bootstrap_reference_models(cache, quick=quick, progress=not quick, console=console)


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """Agents and services log every step at INFO; the loop shows its own progress."""
    import logging

    names = (
        "edge_agent",
        "cloud_service",
        "distill",
        "shared",
        "uvicorn",
        "httpx",
        "amqtt",
        "alembic",
    )
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_closed_loop(
    settings: EdgeLoopSettings | None = None,
    *,
    quick: bool,
    frames: int = 400,
    agents: int = 3,
    drift: str = "blur:0.8",
    threshold: float = 0.85,
    max_samples: int = 500,
    threads: int = 2,
    plot: Path | None = None,
    report_html: Path | None = None,
    console: Console | None = None,
    live: bool = True,
    models: Any = None,
    job_params: dict[str, Any] | None = None,
    rounds: int = 1,
    stream_renders: int = 16,
) -> dict[str, Any]:
    """Run the loop once and return its figures (also printed; a plot and a report saved).

    ``models`` overrides the reference models (``distill.cache.ReferenceModels``);
    ``job_params`` adds parameters to the job the drift trigger queues; ``rounds``
    distillation rounds run (from the second on, the drifted stream continues first and
    the trigger must fire again).
    """
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    console = console or Console(stderr=True)
    started = time.perf_counter()
    with _quiet_logs(), LoopProgress(console, live=live) as progress:
        models = models or _models(quick, console)
        report = _run(
            settings,
            models=models,
            quick=quick,
            frames=frames,
            agents=agents,
            drift=drift,
            threshold=threshold,
            max_samples=max_samples,
            threads=threads,
            progress=progress,
            started=started,
            job_params=job_params or {},
            rounds=rounds,
            stream_renders=stream_renders,
        )
    report["goals"] = _goals(report)
    report["goal_columns"] = goal_columns(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    _print_table(console, report)
    plot = plot or Path("closed_loop.svg")
    _write_svg(plot, report)
    report["plot"] = str(plot)
    if report_html is not None:
        from simulations.report import write_report

        write_report(report_html, report)
        report["report"] = str(report_html)
        console.print(f"report: {report_html.resolve()}")
    return report


def _run(
    settings: EdgeLoopSettings | None,
    *,
    models: Any,
    quick: bool,
    frames: int,
    agents: int,
    drift: str,
    threshold: float,
    max_samples: int,
    threads: int,
    progress: LoopProgress,
    started: float,
    job_params: dict[str, Any],
    rounds: int,
    stream_renders: int,
) -> dict[str, Any]:
    from sqlalchemy import case, func, select

    from cloud_service import registry
    from cloud_service.announce import MqttAnnouncer
    from cloud_service.api import create_app
    from cloud_service.db import crud
    from cloud_service.db.models import Sample, Verdict
    from cloud_service.settings import CloudSettings
    from cloud_service.worker import VerifierWorker
    from distill import jobs, schedules
    from distill.cache import ReferenceConfig
    from distill.drift import parse_drift_spec
    from distill.pipeline import TRAINABLE_STATUSES, PipelineServices, make_runner
    from distill.scenario import render_split
    from distill.worker import DistillWorker
    from edge_agent.sources.http import ApiServer
    from shared import EmbeddedBroker, MqttTarget

    scenario = ReferenceConfig.reference(quick=quick).scenario
    # The stream scans are never trained on, so rendering each more often changes no
    # model: it gives the cameras fresh pictures of the same scans, as a real line shows
    # the same kinds of object in new positions, instead of repeating a few hundred.
    stream = render_split("stream", replace(scenario, stream_renders=stream_renders))
    live_pool, eval_pool = split_pool(stream)
    spec = tuple(parse_drift_spec(drift))
    teacher = _session(models.teacher_onnx)
    timeline = _Timeline(started)
    report: dict[str, Any] = {
        "drift": drift,
        "agents": agents,
        "frames_per_phase": frames,
        "threshold": threshold,
        "quick": quick,
        "rounds_requested": rounds,
        "pools": {
            "live_frames": len(live_pool),
            "evaluation_frames": len(eval_pool),
            "stream_renders": stream_renders,
        },
    }
    prefix = settings.topic_prefix if settings else "edgeloop/v1"

    with ExitStack() as stack:
        # Everything the run stores (database, blobs, spools) goes when it ends.
        tmp = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="edgeloop-loop-", ignore_cleanup_errors=True)
            )
        )
        broker = stack.enter_context(EmbeddedBroker())
        cloud = CloudSettings(
            data_dir=tmp / "cloud",
            mqtt_url=broker.url,
            teacher_model=models.teacher_onnx,
            blob_fsync=False,
            max_queue_delay_ms=2.0,
            review_audit_share=0.0,
            topic_prefix=prefix,
            rollout_tick_s=0,
        )
        topics = cloud.topics
        verifier = VerifierWorker(cloud)
        verifier.start()
        stack.callback(verifier.stop)
        announcer = MqttAnnouncer(cloud.mqtt, client_id="closed-loop-announcer")
        stack.callback(announcer.close)
        app = create_app(cloud, worker=verifier, announcer=announcer)
        state = app.state.edgeloop
        sessions, key = state.sessions, state.signing_key
        server = stack.enter_context(ApiServer(app))
        progress.note(
            f"[bold]closed loop[/]: broker {broker.url}, cloud API {server.url},"
            f" {agents} agents, {frames} frames/agent/phase, drift {drift}"
        )
        with sessions.begin() as s:
            ref = registry.register_model(
                session=s,
                blobs=state.blobs,
                key=key,
                artifact=models.student_int8_onnx,
                name=MODEL,
                format="int8",
            )
            ref_version = ref.version
            registry.promote(
                session=s,
                announcer=announcer,
                topics=topics,
                fleet=FLEET,
                name=MODEL,
                version=ref_version,
                key=key,
            )
            params: dict[str, Any] = {
                "fleet": FLEET,
                "max_samples": max_samples,
                "threads": threads,
                "drift_eval": drift,
                # The whole reference test set under the drift, not a sample of it:
                # on 200 frames a point is two frames, and a round that fell a point
                # on the stream's unseen scans passed the check.
                "drift_eval_frames": 100_000,
                # Best of three training seeds by validation NLL: a round on a few
                # hundred frames varies by a point from one seed to the next.
                "candidates": 3,
                # A round must not fall on unseen scans under the drift it answers:
                # the live pool shows each of its scans again in new renders, so the
                # recent holdout alone can reward a student that learnt those scans.
                "max_drift_drop": 0.02,
                **job_params,
            }
            schedules.create_schedule(
                session=s,
                name="drift",
                kind="trigger",
                expression="drift",
                trigger={
                    "fleet": FLEET,
                    "window_s": 3600,
                    "max_disagreement": DISAGREEMENT_BOUND,
                    "min_samples": 50,
                },
                params=params,
            )
            tokens = []
            for i in range(agents):
                name = f"cam-{i + 1}"
                one_time, _ = crud.create_enrollment_token(
                    session=s, fleet=FLEET, agent_id=name, ttl_s=600
                )
                _, api_token = crud.enroll_agent(session=s, token=one_time, agent_id=name)
                tokens.append((name, api_token))

        fleet_agents: list[_LoopAgent] = []
        fleet = _Fleet(fleet_agents, teacher, timeline, progress, frames)
        target = MqttTarget.parse(broker.url)
        for i, (name, api_token) in enumerate(tokens):
            agent_settings = AgentSettings(
                data_dir=tmp / name,
                model_path=models.student_int8_onnx,
                fleet=FLEET,
                agent_id=name,
                mqtt_url=f"mqtt://{target.host}:{target.port}",
                mqtt_protocol="3.1.1",
                topic_prefix=prefix,
                fleet_public_key=key.public_key_b64,
                cloud_url=server.url,
                api_token=api_token,
                route_max_prob_below=threshold,
                intra_op_threads=1,
                warmup_runs=1,
                max_wait_ms=0.5,
                heartbeat_s=5.0,
                resend_after_s=20.0,
                updater_nice=0,
            )
            agent = _LoopAgent(
                agent_settings, loop=fleet, start_sources=False, rng=random.Random(100 + i)
            )
            stack.enter_context(agent)
            fleet_agents.append(agent)

        def on_version(version: str, timeout: float = 60.0) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all(a.engine.version == version for a in fleet_agents):
                    return True
                time.sleep(0.1)
            return False

        report["audit_share"] = fleet_agents[0].settings.audit_share if fleet_agents else None
        ready = on_version(ref_version)
        report["serving_version"] = ref_version
        progress.note(
            f"{agents} agents enrolled; serving {ref_version}"
            + ("" if ready else " [yellow](not every agent confirmed it)[/]")
        )

        def wait_verified(timeout: float = 120.0) -> int:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with sessions() as s:
                    pending = s.scalar(
                        select(func.count()).select_from(Sample).where(Sample.status == "pending")
                    )
                if not pending:
                    break
                time.sleep(0.2)
            with sessions() as s:
                return int(s.scalar(select(func.count()).select_from(Sample)) or 0)

        def show(title: str, row: dict[str, Any]) -> None:
            progress.note(
                f"[bold]{title}[/]: edge {row['edge_accuracy']:.1%}, forward"
                f" {row['forward_rate']:.1%}, hybrid {row['hybrid_accuracy']:.1%},"
                f" teacher-only {row['teacher_only_accuracy']:.1%}"
            )

        # -- the fleet before and under drift (live pool) --------------------------------
        report["live_before"] = fleet.run_phase("clean", live_pool, (), 1, live=True)
        show("clean (live)", report["live_before"])
        wait_verified()
        with sessions.begin() as s:
            fired_early = schedules.tick(session=s)
        report["trigger_fired_before_drift"] = bool(fired_early)
        timeline.mark("drift starts")
        report["live_drifted"] = fleet.run_phase("drifted", live_pool, spec, 2, live=True)
        show("drifted (live)", report["live_drifted"])
        stored = wait_verified()

        # -- the serving student on the evaluation frames (measured, nothing sent) -----
        report["before"] = fleet.run_phase(
            "measure: clean", eval_pool, (), EVAL_CLEAN_SEED, live=False
        )
        report["drifted"] = fleet.run_phase(
            "measure: drifted", eval_pool, spec, EVAL_DRIFT_SEED, live=False
        )
        show("serving student, evaluation frames, clean", report["before"])
        show("serving student, evaluation frames, drifted", report["drifted"])

        # -- the trigger ---------------------------------------------------------------
        with sessions.begin() as s:
            schedule = schedules.list_schedules(session=s)[0]
            check = schedules.evaluate_trigger(session=s, schedule=schedule, now=datetime.now(UTC))
            fired = fired_early if fired_early else schedules.tick(session=s)
        report["samples_stored"] = stored
        report["trigger_fired"] = bool(fired)
        report["trigger_stats"] = check.stats
        progress.note(f"trigger fired: {bool(fired)} (jobs {fired}); {stored} samples stored")

        services = PipelineServices(
            sessions=sessions,
            blobs=state.blobs,
            work_dir=tmp,
            signing_key=key,
            announcer=announcer,
            topics=topics,
            base_checkpoint=models.student_pt,
            teacher_model=models.teacher_onnx,
            scenario=scenario,
            console_progress=progress.job,
        )
        worker = DistillWorker(sessions, runner=make_runner(services), lease_s=30)

        def new_verified(since: datetime) -> tuple[int, int]:
            """(trainable samples verified since, of which the teacher disagreed with the edge)."""
            with sessions() as s:
                total, disagree = s.execute(
                    select(
                        func.count(),
                        func.sum(case((Verdict.agrees_with_edge.is_(False), 1), else_=0)),
                    )
                    .select_from(Verdict)
                    .join(Sample, Sample.sample_id == Verdict.sample_id)
                    .where(
                        Sample.fleet == FLEET,
                        Sample.status.in_(TRAINABLE_STATUSES),
                        Verdict.verified_at > since,
                    )
                ).one()
            return int(total or 0), int(disagree or 0)

        rounds_out: list[dict[str, Any]] = []
        report["rounds"] = rounds_out
        for k in range(1, rounds + 1):
            round_wall0 = time.perf_counter()
            entry: dict[str, Any] = {"round": k}
            if k == 1:
                entry.update(trigger_fired=bool(fired), trigger_stats=check.stats)
                entry["samples_new"] = stored
            else:
                # -- the drifted stream continues on the serving (round k-1) student -------
                cutoff = datetime.now(UTC)
                timeline.mark(f"round {k}: the drifted stream continues")
                entry["live_drifted"] = fleet.run_phase(
                    f"drifted, round {k}", live_pool, spec, 10 + k, live=True
                )
                show(f"drifted (live), round {k}", entry["live_drifted"])
                wait_verified()
                new, new_disagree = new_verified(cutoff)
                entry["samples_new"] = new
                entry["new_samples_disagreement"] = new_disagree / new if new else None
                with sessions.begin() as s:
                    schedule = schedules.list_schedules(session=s)[0]
                    check_k = schedules.evaluate_trigger(
                        session=s, schedule=schedule, now=datetime.now(UTC)
                    )
                    fired_k = schedules.tick(session=s)
                entry.update(trigger_fired=bool(fired_k), trigger_stats=check_k.stats)
                progress.note(
                    f"round {k}: trigger fired: {bool(fired_k)} ({check_k.reason});"
                    f" {new} newly verified samples"
                    + (
                        ""
                        if not new
                        else f", teacher disagreed with the edge on {new_disagree / new:.1%}"
                    )
                )
                if not fired_k:
                    entry.update(job=None, skipped="the trigger did not fire")
                    rounds_out.append(entry)
                    break

            # -- the round: job, delivery --------------------------------------------------
            round_started = time.perf_counter()
            t_round = timeline.now()
            job_id = worker.run_once()
            job_wall = time.perf_counter() - round_started
            with sessions() as s:
                job = jobs.get_job(session=s, job_id=job_id) if job_id else None
                entry["job"] = (
                    None
                    if job is None
                    else {
                        "id": job.id,
                        "state": job.state,
                        "error": job.error,
                        "version": job.result_version,
                        "gate": job.metrics.get("gate"),
                        "evaluation": job.metrics.get("evaluation"),
                        "dataset": job.metrics.get("dataset"),
                        "train": job.metrics.get("train"),
                        "calibration": job.metrics.get("calibration"),
                        "warm_start": job.metrics.get("warm_start"),
                        "parent_version": job.metrics.get("parent_version"),
                        "timings": job.metrics.get("timings"),
                    }
                )
            want = entry["job"]["version"] if entry["job"] else None
            delivered = on_version(want, timeout=60.0) if want else False
            entry["agents_on"] = {a.settings.agent_id: a.engine.version for a in fleet_agents}
            entry["delivered"] = delivered
            entry["round_s"] = round(time.perf_counter() - round_started, 1)
            entry["job_wall_s"] = round(job_wall, 1)
            with timeline.lock:
                n = len(timeline.frames)
                timeline.spans.append((f"distillation round {k}", n, n, t_round, timeline.now()))
            progress.note(
                f"round {k} took {entry['round_s']} s (job {entry['job_wall_s']} s);"
                f" agents now on {entry['agents_on']}"
            )
            gate = entry["job"]["gate"] if entry["job"] else None
            if gate and not gate["passed"]:
                progress.note(f"[yellow]round {k}: gate refused: {gate['reasons']}[/]")

            # -- after: new frames (evaluation pool) -------------------------------------
            # Only the last round's column is live: a later round trains on the newest
            # verified samples, and no evaluation frame may be among them.
            last_round = k == rounds
            entry["after"] = fleet.run_phase(
                f"after round {k}", eval_pool, spec, EVAL_DRIFT_SEED, live=last_round
            )
            show(
                f"after round {k}, evaluation frames, drifted" + (" (live)" if last_round else ""),
                entry["after"],
            )
            entry["after_clean"] = fleet.run_phase(
                f"measure: clean after round {k}", eval_pool, (), EVAL_CLEAN_SEED, live=False
            )
            show(f"after round {k}, evaluation frames, clean", entry["after_clean"])
            entry["round_wall_s"] = round(time.perf_counter() - round_wall0, 1)
            rounds_out.append(entry)

        # The top-level figures are the last completed round's (the fleet's final state).
        done = [e for e in rounds_out if "after" in e]
        if done:
            last = done[-1]
            for name in (
                "job",
                "agents_on",
                "delivered",
                "round_s",
                "job_wall_s",
                "after",
                "after_clean",
            ):
                report[name] = last[name]
        report["versions"] = {"before": ref_version, "after": report.get("agents_on")}

    report["timeline"] = timeline.as_dict()
    return report


def _rounds(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds that were measured (each with ``after`` and ``after_clean``)."""
    done = [e for e in r.get("rounds") or [] if "after" in e]
    if done:
        return done
    return [{"round": 1, "after": r["after"], "after_clean": r["after_clean"]}]


def _column(entry: dict[str, Any], count: int) -> str:
    name = f"after round {entry['round']}"
    return f"{name} (steady state)" if count > 1 and entry["round"] == count else name


# Which column each goal reads: the first round's goals from round 1, the steady-state
# goals from the last round.
_FIRST_ROUND_GOALS = (
    "drifted_acc_ge_90pct_of_pre",
    "half_gap_closed",
    "gap_closed_share",
    "forgetting_le_2pt",
    "forward_rate_down_30pct",
)
_STEADY_GOALS = ("hybrid_ge_99pct_teacher", "forward_le_25pct", "uplink_le_10pct")


def goal_columns(r: dict[str, Any]) -> dict[str, str]:
    rounds = _rounds(r)
    first, last = _column(rounds[0], len(rounds)), _column(rounds[-1], len(rounds))
    return {
        **{name: first for name in _FIRST_ROUND_GOALS},
        **{name: last for name in _STEADY_GOALS},
    }


def _goals(r: dict[str, Any]) -> dict[str, Any]:
    rounds = _rounds(r)
    first, last = rounds[0], rounds[-1]
    pre, drifted, after = (
        r["before"]["edge_accuracy"],
        r["drifted"]["edge_accuracy"],
        first["after"]["edge_accuracy"],
    )
    gap = pre - drifted
    steady = last["after"]
    return {
        "drifted_acc_ge_90pct_of_pre": after >= 0.9 * pre,
        "half_gap_closed": gap <= 0 or (after - drifted) >= 0.5 * gap,
        "gap_closed_share": None if gap <= 0 else round((after - drifted) / gap, 3),
        "forgetting_le_2pt": pre - first["after_clean"]["edge_accuracy"] <= 0.02,
        "forward_rate_down_30pct": first["after"]["forward_rate"]
        <= 0.7 * r["drifted"]["forward_rate"],
        "hybrid_ge_99pct_teacher": steady["hybrid_accuracy"]
        >= 0.99 * steady["teacher_only_accuracy"],
        "forward_le_25pct": steady["forward_rate"] <= 0.25,
        "uplink_le_10pct": steady["uplink_share"] <= 0.10,
    }


def table_header(r: dict[str, Any]) -> list[str]:
    """The headline table's column names."""
    rounds = _rounds(r)
    return ["", "before drift", "drifted", *(_column(e, len(rounds)) for e in rounds)]


def table_rows(r: dict[str, Any]) -> list[tuple[str, ...]]:
    """The headline table: (figure, before drift, drifted, after round 1, ..., after round N)."""
    rounds = _rounds(r)

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    def row(label: str, key: str) -> tuple[str, ...]:
        return (
            label,
            pct(r["before"][key]),
            pct(r["drifted"][key]),
            *(pct(e["after"][key]) for e in rounds),
        )

    return [
        (
            "edge acc, drifted stream",
            "-",
            pct(r["drifted"]["edge_accuracy"]),
            *(pct(e["after"]["edge_accuracy"]) for e in rounds),
        ),
        (
            "edge acc, clean stream",
            pct(r["before"]["edge_accuracy"]),
            "-",
            *(pct(e["after_clean"]["edge_accuracy"]) for e in rounds),
        ),
        row("forward rate", "forward_rate"),
        row("hybrid accuracy", "hybrid_accuracy"),
        row("teacher-only accuracy", "teacher_only_accuracy"),
        row("uplink vs every frame", "uplink_share"),
    ]


def _print_table(console: Console, r: dict[str, Any]) -> None:
    table = Table(title=f"closed loop: {r['agents']} agents, drift {r['drift']}")
    header = table_header(r)
    table.add_column(header[0])
    for col in header[1:]:
        table.add_column(col, justify="right")
    for row in table_rows(r):
        table.add_row(*row)
    console.print(table)
    for e in r.get("rounds") or []:
        if "after" not in e:
            console.print(f"round {e['round']}: not run ({e.get('skipped')})")
            continue
        version = e["job"]["version"] if e.get("job") else None
        console.print(
            f"round {e['round']} (trigger -> job -> agents): {e['round_s']} s"
            f" (job {e['job_wall_s']} s; with its streams {e['round_wall_s']} s),"
            f" {e.get('samples_new')} newly verified samples, model {version}"
        )
    console.print(f"whole run {r['wall_s']} s")
    columns = r.get("goal_columns", {})
    console.print(
        "goals: "
        + ", ".join(
            f"{k}={v} [{columns[k]}]" if k in columns else f"{k}={v}" for k, v in r["goals"].items()
        ),
        highlight=False,
    )


def _write_svg(path: Path, r: dict[str, Any]) -> None:
    """A small bar chart (edge accuracy and forward rate per column), no plotting library."""
    bars: list[tuple[str, float, float | None, str]] = [
        ("clean, before", r["before"]["edge_accuracy"], r["before"]["forward_rate"], ""),
        ("drifted", r["drifted"]["edge_accuracy"], r["drifted"]["forward_rate"], ""),
    ]
    for e in _rounds(r):
        version = str((e.get("job") or {}).get("version") or "")
        served = sorted(set((e.get("agents_on") or {}).values()))
        marker = ", ".join(served) if served else version
        k = e["round"]
        bars.append(
            (f"round {k}, drifted", e["after"]["edge_accuracy"], e["after"]["forward_rate"], marker)
        )
        bars.append((f"round {k}, clean", e["after_clean"]["edge_accuracy"], None, marker))
    step = 125
    w, h, base = max(560, 60 + step * len(bars)), 320, 250
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"'
        ' font-family="sans-serif" font-size="12">',
        f'<text x="10" y="18" font-size="14">EdgeLoop closed loop: drift {r["drift"]}</text>',
        f'<line x1="40" y1="{base}" x2="{w - 10}" y2="{base}" stroke="#333"/>',
    ]
    for i, (label, acc, fwd, version) in enumerate(bars):
        x = 60 + i * step
        ah = acc * 200
        parts.append(
            f'<rect x="{x}" y="{base - ah:.1f}" width="40" height="{ah:.1f}" fill="#3b7dd8"/>'
        )
        parts.append(f'<text x="{x}" y="{base - ah - 4:.1f}">{100 * acc:.1f}%</text>')
        if fwd is not None:
            fh = fwd * 200
            parts.append(
                f'<rect x="{x + 45}" y="{base - fh:.1f}" width="40" height="{fh:.1f}"'
                ' fill="#e07b39"/>'
            )
            parts.append(f'<text x="{x + 45}" y="{base - fh - 4:.1f}">{100 * fwd:.0f}%</text>')
        parts.append(f'<text x="{x}" y="{base + 16}">{html.escape(label)}</text>')
        if version:
            parts.append(
                f'<text class="version-marker" data-version="{html.escape(version)}"'
                f' x="{x}" y="{base + 32}" fill="#6a3d9a">model {html.escape(version)}</text>'
            )
    lx = w - 180
    parts.append(
        f'<rect x="{lx}" y="30" width="10" height="10" fill="#3b7dd8"/>'
        f'<text x="{lx + 15}" y="39">edge accuracy</text>'
    )
    parts.append(
        f'<rect x="{lx}" y="46" width="10" height="10" fill="#e07b39"/>'
        f'<text x="{lx + 15}" y="55">forward rate</text>'
    )
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast-trained models")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--frames", type=int, default=400, help="frames per agent per phase")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="distillation rounds")
    parser.add_argument("--drift", default="blur:0.8")
    parser.add_argument("--threshold", type=float, default=0.85)
    parser.add_argument("--threads", type=int, default=2, help="the job's thread limit")
    parser.add_argument("--plot", type=Path, default=Path("closed_loop.svg"))
    parser.add_argument("--report", type=Path, default=None, help="write an HTML report here")
    parser.add_argument("--stream-renders", type=int, default=16, help="renders per stream scan")
    args = parser.parse_args()
    report = run_closed_loop(
        None,
        quick=args.quick,
        frames=args.frames,
        agents=args.agents,
        drift=args.drift,
        threshold=args.threshold,
        threads=args.threads,
        plot=args.plot,
        report_html=args.report,
        rounds=args.rounds,
        stream_renders=args.stream_renders,
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
