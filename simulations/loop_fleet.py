"""The closed loop's fleet: agents streamed frames, and what each phase measured.

``Fleet.run_phase`` streams frames to every agent at once (a thread each) and returns
the phase's figures (``PhaseStats.row``). A live phase sends through the agents as in
the field and waits for the verdicts of what they forwarded; a measuring phase applies
each agent's routing rule without sending (the verdict would be the teacher's answer on
the same bytes). ``Timeline`` keeps what the report plots; ``LoopProgress`` shows the
phases and the distillation job in the terminal.
"""

from __future__ import annotations

import io
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
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

from distill.frames import FrameSet
from edge_agent.agent import Agent, FrameResult
from edge_agent.imaging import encode_for_upload
from edge_agent.routing import Router
from edge_agent.settings import AgentSettings
from shared.errors import MessageError
from shared.ids import new_sample_id
from shared.messages import decode_verdicts

__all__ = ["Fleet", "LoopAgent", "LoopProgress", "PhaseStats", "Timeline"]

VERDICT_WAIT_S = 60.0


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


class Timeline:
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


class LoopAgent(Agent):
    """A real edge agent that also notes when each verdict arrives (latency and hybrid)."""

    def __init__(self, settings: AgentSettings, *, loop: Fleet, **kwargs: Any) -> None:
        super().__init__(settings, **kwargs)
        self.loop = loop

    def handle_message(self, topic: str, payload: bytes) -> None:
        super().handle_message(topic, payload)
        if topic != self.topic_verdicts:
            return
        try:
            verdicts = decode_verdicts(payload)
        except MessageError:
            return  # the agent itself has counted and logged the refusal
        now = time.perf_counter()
        for verdict in verdicts:
            self.loop.on_verdict(verdict.sample_id, verdict.label, now)


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


class Fleet:
    """The agents, their streams, and the bookkeeping that turns answers into figures."""

    def __init__(
        self,
        agents: list[LoopAgent],
        teacher: ort.InferenceSession,
        timeline: Timeline,
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
        envelope = agent.forwarding.envelope(
            sample_id=result.sample_id,
            image=image,
            image_info=info,
            captured_at=datetime.now(UTC),
            model_name=result.model_name,
            model_version=result.model_version,
            answer={
                "scores": result.scores,
                "predicted": result.predicted,
                "confidence": min(1.0, max(0.0, result.confidence)),
                **({"boxes": result.boxes} if result.boxes is not None else {}),
            },
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

        def work(index: int, agent: LoopAgent) -> None:
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

        def guarded(index: int, agent: LoopAgent) -> None:
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
