"""The closed loop, measured: drift hits the fleet, a trigger fires, one distillation round
runs, the new student reaches the agents, and accuracy recovers.

    python -m simulations.closed_loop [--quick] [--json] [--drift blur:0.8] [--agents 3]

On embedded defaults, in one process: an embedded MQTT broker; SQLite and a local
blob folder in a temporary data dir; the cloud verifier (``cloud_service.worker``,
the real one: MQTT ingest, teacher batching, verdicts, samples stored); the model
registry with signed, retained announcements over MQTT; a distill worker
(``distill.worker`` + ``distill.pipeline``) claiming the job the drift trigger queues.

Simplified, honestly: the agents are in-process *simulated* agents, not
``edge_agent.Agent`` processes. Each runs the INT8 student with ONNX Runtime on its
own frames, forwards low-confidence frames (plus an audit share) as real sample
envelopes over MQTT at QoS 1, and follows the fleet's retained model announcement:
it verifies the ed25519 signature and the artifact's sha256 before it swaps models.
It reads the artifact from the blob folder instead of over HTTP, and frames are
processed one agent after another rather than concurrently.

Phases (each agent sees ``frames`` frames per phase, from the reference stream split):
``before`` (clean), ``drifted`` (the drift from the first frame), then one round (the
trigger fires on teacher disagreement; one job; delivery), then ``after`` (drifted
again, new frames) with the clean stream measured alongside for forgetting.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
from PIL import Image
from rich.console import Console
from rich.table import Table

from shared import EmbeddedBroker, MqttTarget, SampleHeader, encode_envelope, make_client
from shared.ids import new_sample_id
from shared.manifest import verify_manifest_bytes
from shared.settings import EdgeLoopSettings

__all__ = ["run_closed_loop"]

FLEET = "demo"
MODEL = "edgeloop-student"
AUDIT_SHARE = 0.02
DISAGREEMENT_BOUND = 0.2  # the drift trigger: teacher disagreement over the window


def _session(path: Path | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    src = str(path) if isinstance(path, Path) else path
    return ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])


def _jpeg(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@dataclass
class PhaseStats:
    frames: int = 0
    edge_correct: int = 0
    forwarded: int = 0
    hybrid_correct: int = 0
    teacher_correct: int = 0
    bytes_sent: int = 0
    bytes_all: int = 0

    def row(self) -> dict[str, float]:
        n = max(1, self.frames)
        return {
            "frames": self.frames,
            "edge_accuracy": self.edge_correct / n,
            "forward_rate": self.forwarded / n,
            "hybrid_accuracy": self.hybrid_correct / n,
            "teacher_only_accuracy": self.teacher_correct / n,
            "uplink_bytes": self.bytes_sent,
            "uplink_all_frames_bytes": self.bytes_all,
            "uplink_share": self.bytes_sent / max(1, self.bytes_all),
        }


@dataclass
class SimAgent:
    """A simulated edge agent: the student, the routing rule, the uplink, model updates."""

    name: str
    client: mqtt.Client
    topics: Any
    public_key: str
    blobs: Any
    threshold: float
    engine: ort.InferenceSession
    version: str = "ref"
    audit: random.Random = field(default_factory=lambda: random.Random(11))
    lock: threading.Lock = field(default_factory=threading.Lock)
    installed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if not msg.payload:
            return
        try:
            manifest = verify_manifest_bytes(bytes(msg.payload), self.public_key)
            if manifest.version == self.version:
                return
            data = self.blobs.get(f"models/{manifest.name}/{manifest.sha256}.onnx")
            if hashlib.sha256(data).hexdigest() != manifest.sha256:
                raise ValueError("sha256 mismatch")
            engine = _session(data)
        except Exception as exc:  # refused: the old model keeps serving
            self.refused.append(str(exc))
            return
        with self.lock:
            self.engine, self.version = engine, manifest.version
        self.installed.append(manifest.version)

    def answer(self, frame: np.ndarray) -> tuple[np.ndarray, str]:
        with self.lock:
            engine, version = self.engine, self.version
        return np.asarray(engine.run(None, {"frames": frame[None]})[0][0]), version

    def process(self, frame: np.ndarray, label: int, teacher: int, stats: PhaseStats) -> None:
        scores, version = self.answer(frame)
        predicted = int(np.argmax(scores))
        confidence = float(scores[predicted])
        stats.frames += 1
        stats.edge_correct += int(predicted == label)
        stats.teacher_correct += int(teacher == label)
        image = _jpeg(frame)
        reason = "low_confidence" if confidence < self.threshold else None
        if reason is None and self.audit.random() < AUDIT_SHARE:
            reason = "audit"
        header = SampleHeader(
            sample_id=new_sample_id(),
            fleet=FLEET,
            agent=self.name,
            captured_at=datetime.now(UTC),
            model_name=MODEL,
            model_version=version,
            scores=[float(s) for s in scores],
            predicted=predicted,
            confidence=confidence,
            route_reason=reason or "audit",
            priority=min(9, int(confidence * 10)),
            image_format="jpeg",
            image_width=frame.shape[1],
            image_height=frame.shape[0],
            image_bytes=len(image),
        )
        payload = encode_envelope(header, image)
        stats.bytes_all += len(payload)
        if reason is None:
            stats.hybrid_correct += int(predicted == label)
            return
        # Forwarded: the verified answer (the teacher's) is the hybrid answer.
        stats.forwarded += 1
        stats.bytes_sent += len(payload)
        stats.hybrid_correct += int(teacher == label)
        self.client.publish(self.topics.samples(FLEET, self.name), payload, qos=1)


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


def run_closed_loop(
    settings: EdgeLoopSettings | None = None,
    *,
    quick: bool,
    frames: int = 400,
    agents: int = 3,
    drift: str = "blur:0.8",
    threshold: float = 0.9,
    max_samples: int = 500,
    threads: int = 1,
    plot: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the loop once and return its figures (also printed, with a plot saved)."""
    from cloud_service import registry
    from cloud_service.announce import MqttAnnouncer
    from cloud_service.api.state import load_signing_key
    from cloud_service.settings import CloudSettings
    from cloud_service.worker import VerifierWorker
    from distill import schedules
    from distill.cache import ReferenceConfig
    from distill.drift import DriftSchedule, FrameStream, parse_drift_spec
    from distill.pipeline import PipelineServices, make_runner
    from distill.scenario import render_split
    from distill.worker import DistillWorker

    console = console or Console(stderr=True)
    started = time.perf_counter()
    models = _models(quick, console)
    scenario = ReferenceConfig.reference(quick=quick).scenario
    pool = render_split("stream", scenario)
    spec = parse_drift_spec(drift)
    teacher = _session(models.teacher_onnx)
    tmp = Path(tempfile.mkdtemp(prefix="edgeloop-closed-loop-"))
    report: dict[str, Any] = {"drift": drift, "agents": agents, "frames_per_phase": frames}

    with EmbeddedBroker() as broker:
        cloud = CloudSettings(
            data_dir=tmp,
            mqtt_url=broker.url,
            teacher_model=models.teacher_onnx,
            blob_fsync=False,
            max_queue_delay_ms=2.0,
            review_audit_share=0.0,
            topic_prefix=settings.topic_prefix if settings else "edgeloop/v1",
        )
        topics = cloud.topics
        verifier = VerifierWorker(cloud)
        verifier.start()
        sessions = verifier.sessions
        key = load_signing_key(cloud)
        announcer = MqttAnnouncer(cloud.mqtt, client_id="closed-loop-announcer")
        with sessions.begin() as s:
            registry.register_model(
                session=s,
                blobs=verifier.blobs,
                key=key,
                artifact=models.student_int8_onnx,
                name=MODEL,
                version="ref",
                format="int8",
            )
            registry.promote(
                session=s,
                announcer=announcer,
                topics=topics,
                fleet=FLEET,
                name=MODEL,
                version="ref",
            )
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
                params={
                    "fleet": FLEET,
                    "max_samples": max_samples,
                    "threads": threads,
                    "drift_eval": f"{drift}",
                    "drift_eval_frames": 200,
                },
            )
        target = MqttTarget.parse(broker.url)
        fleet_agents: list[SimAgent] = []
        for i in range(agents):
            name = f"cam-{i + 1}"
            client = make_client(target, client_id=f"sim-{name}", protocol="3.1.1")
            agent = SimAgent(
                name=name,
                client=client,
                topics=topics,
                public_key=key.public_key_b64,
                blobs=verifier.blobs,
                threshold=threshold,
                engine=_session(models.student_int8_onnx),
            )
            client.on_message = agent.on_message
            client.connect(target.host, target.port)
            client.subscribe(topics.fleet_models(FLEET), qos=1)
            client.loop_start()
            fleet_agents.append(agent)
        time.sleep(0.5)

        def phase(name: str, drifted: bool, seed: int, forward: bool = True) -> dict[str, float]:
            stats = PhaseStats()
            streams = [
                iter(
                    FrameStream(
                        pool,
                        drift=spec if drifted else (),
                        schedule=DriftSchedule("abrupt", 0),
                        limit=frames,
                        seed=seed * 100 + i,
                    )
                )
                for i in range(agents)
            ]
            for step in range(frames):
                for agent, stream in zip(fleet_agents, streams, strict=True):
                    item = next(stream)
                    t_label = int(np.argmax(teacher.run(None, {"frames": item.frame[None]})[0][0]))
                    if forward:
                        agent.process(item.frame, item.label, t_label, stats)
                    else:  # measurement only: nothing goes to the cloud
                        scores, _ = agent.answer(item.frame)
                        stats.frames += 1
                        stats.edge_correct += int(int(np.argmax(scores)) == item.label)
                        stats.teacher_correct += int(t_label == item.label)
                if step % 100 == 0:
                    console.print(f"  {name}: {step}/{frames} frames per agent")
            row = stats.row()
            console.print(
                f"[bold]{name}[/]: "
                + ", ".join(
                    f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and v <= 1
                )
            )
            return row

        def wait_verified(timeout: float = 120.0) -> int:
            from sqlalchemy import func, select

            from cloud_service.db.models import Sample

            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with sessions() as s:
                    pending = s.scalar(
                        select(func.count()).select_from(Sample).where(Sample.status == "pending")
                    )
                if not pending:
                    break
                time.sleep(0.2)
            time.sleep(0.5)
            with sessions() as s:
                return int(s.scalar(select(func.count()).select_from(Sample)) or 0)

        console.print(
            f"[bold]closed loop[/]: {agents} agents, {frames} frames/agent/phase, drift {drift}"
        )
        report["before"] = phase("before drift (clean)", False, 1)
        report["before_clean_edge"] = report["before"]["edge_accuracy"]
        wait_verified()
        with sessions.begin() as s:
            fired_early = schedules.tick(session=s)
        report["trigger_fired_before_drift"] = bool(fired_early)
        report["drifted"] = phase("drifted", True, 2)
        report["drifted_clean"] = phase("drifted: clean stream (measure)", False, 3, forward=False)
        stored = wait_verified()
        with sessions.begin() as s:
            fired = fired_early if fired_early else schedules.tick(session=s)
            check = schedules.evaluate_trigger(
                session=s,
                schedule=schedules.list_schedules(session=s)[0],
                now=datetime.now(UTC),
            )
        report["samples_stored"] = stored
        report["trigger_fired"] = bool(fired)
        report["trigger_stats"] = check.stats
        console.print(
            f"trigger fired: {bool(fired)} (jobs {fired}); {stored} samples; {check.stats}"
        )

        # -- one round -----------------------------------------------------------------
        round_started = time.perf_counter()

        def show(job_id: int, phase_: str, percent: float) -> None:
            console.print(f"  job {job_id}: {phase_} {percent:5.1f}%", highlight=False)

        last = {"p": ""}

        def throttled(job_id: int, phase_: str, percent: float) -> None:
            key_ = f"{phase_}{int(percent) // 10}"
            if key_ != last["p"]:
                last["p"] = key_
                show(job_id, phase_, percent)

        services = PipelineServices(
            sessions=sessions,
            blobs=verifier.blobs,
            work_dir=tmp,
            signing_key=key,
            announcer=announcer,
            topics=topics,
            base_checkpoint=models.student_pt,
            teacher_model=models.teacher_onnx,
            scenario=scenario,
            console_progress=throttled,
        )
        worker = DistillWorker(sessions, runner=make_runner(services), lease_s=30)
        job_id = worker.run_once()
        round_s = time.perf_counter() - round_started
        from distill import jobs

        with sessions() as s:
            job = jobs.get_job(session=s, job_id=job_id) if job_id else None
            report["job"] = (
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
                    "timings": job.metrics.get("timings"),
                }
            )
        deadline = time.monotonic() + 20
        want = report["job"]["version"] if report["job"] else None
        while want and time.monotonic() < deadline and any(a.version != want for a in fleet_agents):
            time.sleep(0.1)
        report["agents_on"] = {a.name: a.version for a in fleet_agents}
        report["round_s"] = round(time.perf_counter() - round_started, 1)
        report["job_wall_s"] = round(round_s, 1)
        console.print(f"round took {report['round_s']} s; agents now on {report['agents_on']}")

        report["after"] = phase("after one round (drifted)", True, 4)
        report["after_clean"] = phase(
            "after one round: clean stream (measure)", False, 5, forward=False
        )

        for agent in fleet_agents:
            agent.client.disconnect()
            agent.client.loop_stop()
        announcer.close()
        verifier.stop()

    report["goals"] = _goals(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    _print_table(console, report)
    plot = plot or Path("closed_loop.svg")
    _write_svg(plot, report)
    report["plot"] = str(plot)
    return report


def _goals(r: dict[str, Any]) -> dict[str, Any]:
    pre, drifted, after = (
        r["before"]["edge_accuracy"],
        r["drifted"]["edge_accuracy"],
        r["after"]["edge_accuracy"],
    )
    gap = pre - drifted
    return {
        "drifted_acc_ge_90pct_of_pre": after >= 0.9 * pre,
        "half_gap_closed": gap <= 0 or (after - drifted) >= 0.5 * gap,
        "gap_closed_share": None if gap <= 0 else round((after - drifted) / gap, 3),
        "forgetting_le_2pt": r["before"]["edge_accuracy"] - r["after_clean"]["edge_accuracy"]
        <= 0.02,
        "forward_rate_down_30pct": r["after"]["forward_rate"] <= 0.7 * r["drifted"]["forward_rate"],
        "hybrid_ge_99pct_teacher": r["after"]["hybrid_accuracy"]
        >= 0.99 * r["after"]["teacher_only_accuracy"],
        "forward_le_25pct": r["after"]["forward_rate"] <= 0.25,
        "uplink_le_10pct": r["after"]["uplink_share"] <= 0.10,
    }


def _print_table(console: Console, r: dict[str, Any]) -> None:
    table = Table(title=f"closed loop: {r['agents']} agents, drift {r['drift']}")
    table.add_column("")
    for col in ("before drift", "drifted", "after one round"):
        table.add_column(col, justify="right")

    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    rows = [
        (
            "edge acc, drifted stream",
            "-",
            pct(r["drifted"]["edge_accuracy"]),
            pct(r["after"]["edge_accuracy"]),
        ),
        (
            "edge acc, clean stream",
            pct(r["before"]["edge_accuracy"]),
            pct(r["drifted_clean"]["edge_accuracy"]),
            pct(r["after_clean"]["edge_accuracy"]),
        ),
        (
            "forward rate",
            pct(r["before"]["forward_rate"]),
            pct(r["drifted"]["forward_rate"]),
            pct(r["after"]["forward_rate"]),
        ),
        (
            "hybrid accuracy",
            pct(r["before"]["hybrid_accuracy"]),
            pct(r["drifted"]["hybrid_accuracy"]),
            pct(r["after"]["hybrid_accuracy"]),
        ),
        (
            "teacher-only accuracy",
            pct(r["before"]["teacher_only_accuracy"]),
            pct(r["drifted"]["teacher_only_accuracy"]),
            pct(r["after"]["teacher_only_accuracy"]),
        ),
        (
            "uplink vs every frame",
            pct(r["before"]["uplink_share"]),
            pct(r["drifted"]["uplink_share"]),
            pct(r["after"]["uplink_share"]),
        ),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(f"round (trigger -> job -> agents): {r['round_s']} s; whole run {r['wall_s']} s")
    console.print(f"goals: {r['goals']}")


def _write_svg(path: Path, r: dict[str, Any]) -> None:
    """A small bar chart (edge accuracy and forward rate per phase), no plotting library."""
    bars = [
        ("clean, before", r["before"]["edge_accuracy"], r["before"]["forward_rate"]),
        ("drifted", r["drifted"]["edge_accuracy"], r["drifted"]["forward_rate"]),
        ("after, drifted", r["after"]["edge_accuracy"], r["after"]["forward_rate"]),
        ("after, clean", r["after_clean"]["edge_accuracy"], None),
    ]
    w, h, base = 560, 300, 250
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',  # noqa: E501
        f'<text x="10" y="18" font-size="14">EdgeLoop closed loop: drift {r["drift"]}</text>',
        f'<line x1="40" y1="{base}" x2="{w - 10}" y2="{base}" stroke="#333"/>',
    ]
    for i, (label, acc, fwd) in enumerate(bars):
        x = 60 + i * 125
        ah = acc * 200
        parts.append(
            f'<rect x="{x}" y="{base - ah:.1f}" width="40" height="{ah:.1f}" fill="#3b7dd8"/>'
        )
        parts.append(f'<text x="{x}" y="{base - ah - 4:.1f}">{100 * acc:.1f}%</text>')
        if fwd is not None:
            fh = fwd * 200
            parts.append(
                f'<rect x="{x + 45}" y="{base - fh:.1f}" width="40" height="{fh:.1f}" fill="#e07b39"/>'  # noqa: E501
            )
            parts.append(f'<text x="{x + 45}" y="{base - fh - 4:.1f}">{100 * fwd:.0f}%</text>')
        parts.append(f'<text x="{x}" y="{base + 16}">{label}</text>')
    parts.append(
        '<rect x="380" y="30" width="10" height="10" fill="#3b7dd8"/><text x="395" y="39">edge accuracy</text>'  # noqa: E501
    )
    parts.append(
        '<rect x="380" y="46" width="10" height="10" fill="#e07b39"/><text x="395" y="55">forward rate</text>'  # noqa: E501
    )
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast-trained models")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--frames", type=int, default=400, help="frames per agent per phase")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--drift", default="blur:0.8")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=1, help="the job's thread limit")
    parser.add_argument("--plot", type=Path, default=Path("closed_loop.svg"))
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
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
