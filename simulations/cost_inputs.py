"""The cost model's measured inputs: this system's figures, each with where it came from.

Edge latency and capacity, verifier throughput and capture-to-verdict latency, and
envelope bytes come from ``bench/results/latest.json`` (``make bench``), the verifier's
figures from a fleet run when one is given (``edgeloop sim fleet --json``); the
accuracy of each processing location is measured here, by running the reference
student (INT8) and teacher on the reference stream (``measure_stream``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

__all__ = [
    "DEFAULT_BENCH",
    "Measured",
    "load_measured",
    "measure_stream",
    "merge_bench",
    "reference_models",
]

DEFAULT_BENCH = Path("bench/results/latest.json")


@dataclass(frozen=True)
class Measured:
    """This system's measured figures the model uses, with where each came from."""

    edge_p50_ms: float
    edge_p99_ms: float
    edge_capacity_fps: float
    verifier_per_s: float
    verifier_kind: str  # "cpu" or "gpu": which instance price applies
    cloud_p50_ms: float
    cloud_p99_ms: float
    envelope_bytes: int
    verdict_bytes: int
    sources: dict[str, str] = field(default_factory=dict)


def _verdict_bytes() -> int:
    """Bytes of one verdict message as the verifier encodes it (ten classes)."""
    from shared.ids import new_sample_id
    from shared.messages import Verdict, encode_message

    verdict = Verdict(
        sample_id=new_sample_id(),
        fleet="warehouse-eu-1",
        agent="conveyor-cam-042",
        teacher_model="teacher",
        teacher_version="2026.11.29-1",
        scores=[0.9123, 0.0312, 0.0111, 0.0101, 0.0099, 0.0088, 0.0077, 0.0066, 0.0012, 0.0011],
        label=0,
        confidence=0.9123,
        agrees_with_edge=True,
        review=False,
        verified_at=datetime.now(UTC),
    )
    return len(encode_message(verdict))


# The agent bench's entry for the 64 px reference student, the projection's edge figures.
REFERENCE_STUDENT = "reference student int8"


def merge_bench(paths: Sequence[Path]) -> dict[str, tuple[dict[str, Any], str]]:
    """Each bench section from the first of ``paths`` that has it, with a citation.

    ``make bench --only X`` rewrites ``latest.json`` with one section; listing an
    older full run after it keeps the other sections available, each cited by file
    and run time.
    """
    sections: dict[str, tuple[dict[str, Any], str]] = {}
    for path in paths:
        bench = json.loads(Path(path).read_text())
        cite = f"{path} (run {bench.get('started_at', '?')})"
        for name, section in bench.get("sections", {}).items():
            if name not in sections and "figures" in section:
                sections[name] = (section["figures"], cite)
    return sections


def load_measured(
    bench_path: Path | Sequence[Path] = DEFAULT_BENCH,
    *,
    fleet_report: dict[str, Any] | None = None,
    frame_px: int = 64,
    verifier_per_s: float | None = None,
    verifier_kind: str = "cpu",
) -> Measured:
    """The measured inputs: the bench results, overridden by a fleet run where given."""
    paths = [bench_path] if isinstance(bench_path, Path) else list(bench_path)
    sections = merge_bench(paths)
    for name in ("agent", "cloud", "envelope"):
        if name not in sections:
            raise KeyError(f"no bench results with a {name!r} section in {[str(p) for p in paths]}")
    agent = sections["agent"][0].get(REFERENCE_STUDENT)
    if agent is None:
        raise KeyError(
            f"the agent section of {sections['agent'][1]} has no {REFERENCE_STUDENT!r}: the"
            " 64 px reference student was not built when it ran; build it"
            " (`edgeloop models bootstrap`), then `make bench BENCH_ARGS=--only agent`"
        )
    cloud = sections["cloud"][0]
    envelope = sections["envelope"][0][f"{frame_px}px"]
    a_cite, c_cite, e_cite = sections["agent"][1], sections["cloud"][1], sections["envelope"][1]
    sources = {
        "edge_p50_ms": f"{a_cite}: agent.'reference student int8'.video_p50_ms (video source,"
        " edge agent, 2 cores)",
        "edge_p99_ms": f"{a_cite}: agent.'reference student int8'.video_p99_ms",
        "edge_capacity_fps": f"{a_cite}: agent.'reference student int8'.video_fps",
        "verifier_per_s": f"{c_cite}: cloud.e2e_samples_per_s (demo teacher, CPU,"
        f" {cloud.get('e2e_database')}, Mosquitto, one 2-core host)",
        "cloud_p50_ms": f"{c_cite}: cloud.capture_to_verdict_p50_ms at"
        f" {cloud.get('latency_rate_per_s')}/s (loopback)",
        "cloud_p99_ms": f"{c_cite}: cloud.capture_to_verdict_p99_ms (loopback)",
        "envelope_bytes": f"{e_cite}: envelope.'{frame_px}px'.envelope_bytes",
        "verdict_bytes": "encode_message(Verdict) of a ten-class verdict, measured here",
    }
    per_s = float(cloud["e2e_samples_per_s"])
    p50, p99 = float(cloud["capture_to_verdict_p50_ms"]), float(cloud["capture_to_verdict_p99_ms"])
    if fleet_report is not None:
        knee = fleet_report["knee"]
        healthy = [s for s in fleet_report["steps"] if s.get("healthy")]
        if knee.get("last_healthy_per_s"):
            per_s = float(knee["last_healthy_per_s"])
            sources["verifier_per_s"] = (
                f"fleet run: last healthy step ({knee['last_healthy_agents']} agents) of"
                f" {fleet_report['teacher']}, verdicts/s"
            )
        if healthy:
            best = healthy[-1]
            p50, p99 = float(best["p50_ms"]), float(best["p99_ms"])
            sources["cloud_p50_ms"] = (
                f"fleet run: p50 capture-to-verdict at {best['agents']} agents (loopback)"
            )
            sources["cloud_p99_ms"] = (
                f"fleet run: p99 capture-to-verdict at {best['agents']} agents (loopback)"
            )
    if verifier_per_s is not None:
        per_s = verifier_per_s
        sources["verifier_per_s"] = f"given on the command line ({verifier_kind})"
    return Measured(
        edge_p50_ms=float(agent["video_p50_ms"]),
        edge_p99_ms=float(agent["video_p99_ms"]),
        edge_capacity_fps=float(agent["video_fps"]),
        verifier_per_s=per_s,
        verifier_kind=verifier_kind,
        cloud_p50_ms=p50,
        cloud_p99_ms=p99,
        envelope_bytes=int(envelope["envelope_bytes"]),
        verdict_bytes=_verdict_bytes(),
        sources=sources,
    )


def reference_models(console: Console) -> tuple[Path, Path, str, bool]:
    """Full reference teacher and INT8 student when cached, else the quick pair."""
    from distill.cache import bootstrap_reference_models, reference_model_path
    from shared.errors import EdgeLoopError

    try:
        teacher = reference_model_path("teacher")
        student = reference_model_path("student-int8")
        return teacher, student, "reference (full)", False
    except EdgeLoopError:
        console.print("[yellow]full reference models not cached; using the quick pair[/]")
        models = bootstrap_reference_models(quick=True)
        return models.teacher_onnx, models.student_int8_onnx, "reference (quick)", True


def measure_stream(
    *,
    frames: int = 2000,
    drift: str | None = None,
    seed: int = 7,
    console: Console | None = None,
    models: tuple[Path, Path, str, bool] | None = None,
) -> dict[str, Any]:
    """Run the reference student (INT8) and teacher on ``frames`` frames of the stream.

    Returns per-frame arrays: the student's confidence, whether the student and the
    teacher were right; and the teacher's measured batch-32 throughput on this machine.
    """
    import onnxruntime as ort

    from distill.cache import ReferenceConfig
    from distill.drift import DriftSchedule, FrameStream, parse_drift_spec
    from distill.scenario import render_split

    console = console or Console(stderr=True)
    teacher_path, student_path, which, quick = models or reference_models(console)
    scenario = ReferenceConfig.reference(quick=quick).scenario
    pool = render_split("stream", scenario)
    spec = parse_drift_spec(drift) if drift else ()
    stream = FrameStream(pool, drift=spec, schedule=DriftSchedule("abrupt", 0), seed=seed)
    items = [item for _, item in zip(range(frames), stream, strict=False)]
    batch = np.stack([item.frame for item in items])
    labels = np.array([item.label for item in items])

    options = ort.SessionOptions()
    providers = ["CPUExecutionProvider"]
    student = ort.InferenceSession(str(student_path), options, providers=providers)
    teacher = ort.InferenceSession(str(teacher_path), options, providers=providers)

    def run(session: ort.InferenceSession, size: int) -> tuple[np.ndarray, float]:
        name = session.get_inputs()[0].name
        out = []
        started = time.perf_counter()
        for i in range(0, len(batch), size):
            out.append(np.asarray(session.run(None, {name: batch[i : i + size]})[0]))
        return np.concatenate(out), time.perf_counter() - started

    s_scores, _ = run(student, 64)
    t_scores, t_seconds = run(teacher, 32)
    return {
        "models": which,
        "drift": drift or "clean",
        "frames": len(items),
        "student_confidence": s_scores.max(axis=1),
        "student_correct": s_scores.argmax(axis=1) == labels,
        "teacher_correct": t_scores.argmax(axis=1) == labels,
        "teacher_img_per_s_batch32": round(len(items) / t_seconds, 1),
    }
