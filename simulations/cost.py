"""Edge-only, cloud-only or hybrid: latency, accuracy and compute cost per camera-hour.

    edgeloop sim cost [--fleet-json FLEET.json] [--plot cost.png] [--json]

Two kinds of input, kept apart:

* **Measured** figures of this system, each with where it comes from: edge latency
  and capacity, verifier throughput and capture-to-verdict latency, envelope bytes
  (``bench/results/latest.json``, written by ``make bench``); the verifier's
  throughput and latency from a fleet run when one is given (``edgeloop sim fleet
  --json``); and the accuracy of each processing location, measured here by running
  the reference student (INT8) and teacher on the reference stream.
* **Stated prices and assumptions** (``Prices``): instance prices, an edge device's
  purchase price and power, data transfer prices, camera frame rate, utilisation
  targets, network round trip. Each carries its source or the reason for its value;
  change them with ``--set NAME=VALUE``.

The three processing locations:

* edge-only: the student answers every frame on the edge device;
* cloud-only: every frame travels to the cloud and the verifier answers it;
* hybrid: the student answers every frame at once, and the frames it is unsure of
  (confidence below the threshold) plus an audit share travel to the verifier,
  whose verdict is the final answer for those frames.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

__all__ = [
    "DEFAULT_THRESHOLDS",
    "Measured",
    "Prices",
    "ThresholdPoint",
    "accuracy_curve",
    "cost_table",
    "load_measured",
    "measure_stream",
    "merge_bench",
    "plot_sweep",
    "run_cost",
    "sweep_costs",
]

DEFAULT_BENCH = Path("bench/results/latest.json")
DEFAULT_THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 1.01)


@dataclass(frozen=True)
class Prices:
    """Stated prices and operating assumptions; none of these is measured here."""

    cloud_cpu_usd_per_h: float = 0.0765
    cloud_gpu_usd_per_h: float = 0.526
    edge_device_usd: float = 400.0
    edge_device_months: float = 36.0
    edge_device_watts: float = 15.0
    power_usd_per_kwh: float = 0.15
    site_uplink_usd_per_gb: float = 0.50
    cloud_ingress_usd_per_gb: float = 0.0
    cloud_egress_usd_per_gb: float = 0.09
    camera_fps: float = 10.0
    edge_utilisation: float = 0.5
    cloud_utilisation: float = 0.7
    wan_rtt_ms: float = 40.0

    SOURCES = {
        "cloud_cpu_usd_per_h": "AWS EC2 c6a.large (2 vCPU AMD EPYC, like the 2-core machine the"
        " verifier figures come from), on-demand Linux, us-east-1, list price as of 2024",
        "cloud_gpu_usd_per_h": "AWS EC2 g4dn.xlarge (1x T4), on-demand Linux, us-east-1, list"
        " price as of 2024; used only with a GPU verifier figure (--verifier-kind gpu)",
        "edge_device_usd": "assumption: a 2-4 core x86 mini PC of the class the edge figures"
        " were measured on",
        "edge_device_months": "assumption: straight-line amortisation over 3 years, running 24/7",
        "edge_device_watts": "assumption: mini PC under inference load",
        "power_usd_per_kwh": "assumption: commercial electricity",
        "site_uplink_usd_per_gb": "assumption: metered business LTE/5G at the site; a flat-rate"
        " wired uplink makes this ~0",
        "cloud_ingress_usd_per_gb": "AWS: data transfer into EC2 from the internet is free (2024)",
        "cloud_egress_usd_per_gb": "AWS data transfer out to the internet, first 10 TB/month,"
        " us-east-1, as of 2024 (verdicts and receipts back to the site)",
        "camera_fps": "assumption: frames per second each camera sends to inference",
        "edge_utilisation": "assumption: share of the edge box's measured capacity planned for",
        "cloud_utilisation": "assumption: share of the verifier's measured capacity planned for",
        "wan_rtt_ms": "assumption: round trip from the site to its cloud region (added to the"
        " loopback-measured cloud latency)",
    }

    def table(self) -> list[dict[str, Any]]:
        return [{"name": k, "value": v, "source": self.SOURCES[k]} for k, v in asdict(self).items()]


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


@dataclass(frozen=True)
class ThresholdPoint:
    """Accuracy and forwarded share of the hybrid at one confidence threshold."""

    threshold: float
    forwarded_share: float
    hybrid_accuracy: float
    edge_accuracy: float
    teacher_accuracy: float


# --- measured inputs --------------------------------------------------------------


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
    agent = sections["agent"][0]["reference student int8"]
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


# --- accuracy on the reference stream -----------------------------------------------


def _reference_models(console: Console) -> tuple[Path, Path, str, bool]:
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
    teacher_path, student_path, which, quick = models or _reference_models(console)
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


def accuracy_curve(
    confidence: np.ndarray,
    student_correct: np.ndarray,
    teacher_correct: np.ndarray,
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
    *,
    audit_share: float = 0.01,
) -> list[ThresholdPoint]:
    """Hybrid accuracy and forwarded share per threshold (forward when confidence < t).

    A forwarded frame's final answer is the teacher's; an audit share of the frames
    the student is sure of is forwarded too (its expected effect, not a random draw).
    """
    edge = float(np.mean(student_correct))
    teacher = float(np.mean(teacher_correct))
    points = []
    for t in thresholds:
        low = confidence < t
        rest = ~low
        share = float(np.mean(low) + audit_share * np.mean(rest))
        sure_acc = (1 - audit_share) * student_correct[rest] + audit_share * teacher_correct[rest]
        correct = float(np.sum(teacher_correct[low]) + np.sum(sure_acc))
        points.append(
            ThresholdPoint(
                threshold=t,
                forwarded_share=round(share, 4),
                hybrid_accuracy=round(correct / len(confidence), 4),
                edge_accuracy=round(edge, 4),
                teacher_accuracy=round(teacher, 4),
            )
        )
    return points


# --- cost ------------------------------------------------------------------------


def _edge_usd_per_camera_h(m: Measured, p: Prices) -> tuple[float, int]:
    device_h = p.edge_device_usd / (p.edge_device_months * 730.0)
    power_h = p.edge_device_watts / 1000.0 * p.power_usd_per_kwh
    cameras = max(1, math.floor(m.edge_capacity_fps * p.edge_utilisation / p.camera_fps))
    return (device_h + power_h) / cameras, cameras


def _cloud_usd_per_camera_h(m: Measured, p: Prices, share: float) -> dict[str, float]:
    forwarded_per_s = p.camera_fps * share
    price = p.cloud_gpu_usd_per_h if m.verifier_kind == "gpu" else p.cloud_cpu_usd_per_h
    compute = forwarded_per_s / (m.verifier_per_s * p.cloud_utilisation) * price
    up_gb = forwarded_per_s * 3600 * m.envelope_bytes / 1e9
    down_gb = forwarded_per_s * 3600 * m.verdict_bytes / 1e9
    transfer = (
        up_gb * (p.site_uplink_usd_per_gb + p.cloud_ingress_usd_per_gb)
        + down_gb * p.cloud_egress_usd_per_gb
    )
    return {"compute": compute, "transfer": transfer, "uplink_gb": up_gb}


def cost_table(m: Measured, p: Prices, hybrid: ThresholdPoint) -> list[dict[str, Any]]:
    """One row per processing location: latency, accuracy, cost per camera-hour."""
    edge_usd, cameras = _edge_usd_per_camera_h(m, p)
    cloud_all = _cloud_usd_per_camera_h(m, p, 1.0)
    cloud_h = _cloud_usd_per_camera_h(m, p, hybrid.forwarded_share)
    cloud_p50 = m.cloud_p50_ms + p.wan_rtt_ms
    cloud_p99 = m.cloud_p99_ms + p.wan_rtt_ms
    rows: list[dict[str, Any]] = [
        {
            "location": "edge-only",
            "answer_p50_ms": m.edge_p50_ms,
            "answer_p99_ms": m.edge_p99_ms,
            "verified_share": 0.0,
            "verified_p50_ms": None,
            "verified_p99_ms": None,
            "accuracy": hybrid.edge_accuracy,
            "edge_usd": edge_usd,
            "cloud_compute_usd": 0.0,
            "transfer_usd": 0.0,
            "uplink_gb": 0.0,
        },
        {
            "location": "cloud-only",
            "answer_p50_ms": cloud_p50,
            "answer_p99_ms": cloud_p99,
            "verified_share": 1.0,
            "verified_p50_ms": cloud_p50,
            "verified_p99_ms": cloud_p99,
            "accuracy": hybrid.teacher_accuracy,
            "edge_usd": 0.0,
            "cloud_compute_usd": cloud_all["compute"],
            "transfer_usd": cloud_all["transfer"],
            "uplink_gb": cloud_all["uplink_gb"],
        },
        {
            "location": f"hybrid (t={hybrid.threshold:g})",
            "answer_p50_ms": m.edge_p50_ms,
            "answer_p99_ms": m.edge_p99_ms,
            "verified_share": hybrid.forwarded_share,
            "verified_p50_ms": cloud_p50,
            "verified_p99_ms": cloud_p99,
            "accuracy": hybrid.hybrid_accuracy,
            "edge_usd": edge_usd,
            "cloud_compute_usd": cloud_h["compute"],
            "transfer_usd": cloud_h["transfer"],
            "uplink_gb": cloud_h["uplink_gb"],
        },
    ]
    for row in rows:
        row["usd_per_camera_h"] = row["edge_usd"] + row["cloud_compute_usd"] + row["transfer_usd"]
        row["cameras_per_edge_device"] = cameras if row["edge_usd"] else None
    return rows


def sweep_costs(m: Measured, p: Prices, points: list[ThresholdPoint]) -> list[dict[str, Any]]:
    """The hybrid's accuracy, forwarded share and cost per camera-hour at each threshold."""
    out = []
    for point in points:
        hybrid = cost_table(m, p, point)[2]
        out.append({**asdict(point), "usd_per_camera_h": hybrid["usd_per_camera_h"]})
    return out


def plot_sweep(
    path: Path,
    sweeps: dict[str, list[dict[str, Any]]],
    costs: dict[str, float],
    title: str,
) -> Path:
    """Accuracy, forwarded share and cost against the threshold, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_share, ax_trade) = plt.subplots(1, 3, figsize=(16, 4.8))
    ax_cost = ax_share.twinx()
    colours = ["#3b7dd8", "#d8513b", "#2e9e5b", "#8a4fd8"]
    for colour, (name, rows) in zip(colours, sweeps.items(), strict=False):
        ts = [r["threshold"] for r in rows]
        acc = [100 * r["hybrid_accuracy"] for r in rows]
        share = [100 * r["forwarded_share"] for r in rows]
        usd = [r["usd_per_camera_h"] * 1000 for r in rows]
        ax_acc.plot(ts, acc, "-o", color=colour, label=f"hybrid, {name}")
        ax_acc.axhline(
            100 * rows[0]["edge_accuracy"], color=colour, ls=":", lw=1, label=f"edge-only, {name}"
        )
        ax_acc.axhline(
            100 * rows[0]["teacher_accuracy"],
            color=colour,
            ls="--",
            lw=1,
            label=f"cloud-only, {name}",
        )
        ax_share.plot(ts, share, "-o", color=colour, label=f"forwarded, {name}")
        ax_cost.plot(ts, usd, "--", color=colour, alpha=0.6)
        ax_trade.plot(usd, acc, "-o", color=colour, label=f"hybrid, {name}")
        for t, x, y in zip(ts, usd, acc, strict=True):
            if t in (0.3, 0.5, 0.6, 0.7, 0.9):
                ax_trade.annotate(
                    f"t={t:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(4, -10)
                )
    ax_trade.axvline(costs["edge-only"] * 1000, color="grey", ls=":", label="edge-only cost")
    ax_trade.axvline(costs["cloud-only"] * 1000, color="black", ls="--", label="cloud-only cost")
    ax_acc.set_xlabel("confidence threshold (forward below it)")
    ax_acc.set_ylabel("top-1 accuracy (%)")
    ax_acc.legend(fontsize=7)
    ax_share.set_xlabel("confidence threshold")
    ax_share.set_ylabel("frames forwarded (%), solid")
    ax_cost.set_ylabel("USD per 1,000 camera-hours, dashed")
    ax_share.legend(fontsize=7, loc="upper left")
    ax_trade.set_xlabel("USD per 1,000 camera-hours (edge + cloud + transfer)")
    ax_trade.set_ylabel("top-1 accuracy (%)")
    ax_trade.legend(fontsize=7, loc="lower right")
    for ax in (ax_acc, ax_share, ax_trade):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_cost(
    *,
    bench_path: Path | Sequence[Path] = DEFAULT_BENCH,
    fleet_report: dict[str, Any] | None = None,
    prices: Prices | None = None,
    threshold: float = 0.6,
    audit_share: float = 0.01,
    frames: int = 2000,
    drifts: tuple[str, ...] = ("clean", "blur:0.8"),
    frame_px: int = 64,
    verifier_per_s: float | None = None,
    verifier_kind: str = "cpu",
    plot: Path | None = Path("cost.png"),
    console: Console | None = None,
) -> dict[str, Any]:
    """Measure the accuracy curves, build the table and the sweep; plot when asked."""
    console = console or Console(stderr=True)
    prices = prices or Prices()
    measured = load_measured(
        bench_path,
        fleet_report=fleet_report,
        frame_px=frame_px,
        verifier_per_s=verifier_per_s,
        verifier_kind=verifier_kind,
    )
    thresholds = tuple(sorted({*DEFAULT_THRESHOLDS, threshold}))
    models = _reference_models(console)
    streams: dict[str, Any] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for name in drifts:
        run = measure_stream(
            frames=frames, drift=None if name == "clean" else name, models=models, console=console
        )
        points = accuracy_curve(
            run["student_confidence"],
            run["student_correct"],
            run["teacher_correct"],
            thresholds,
            audit_share=audit_share,
        )
        chosen = next(p for p in points if p.threshold == threshold)
        tables[name] = cost_table(measured, prices, chosen)
        sweeps[name] = sweep_costs(measured, prices, points)
        streams[name] = {
            "frames": run["frames"],
            "models": run["models"],
            "teacher_img_per_s_batch32": run["teacher_img_per_s_batch32"],
        }
    report: dict[str, Any] = {
        "threshold": threshold,
        "audit_share": audit_share,
        "measured": asdict(measured),
        "prices": prices.table(),
        "streams": streams,
        "tables": tables,
        "sweeps": sweeps,
    }
    if plot is not None:
        first = tables[drifts[0]]
        costs = {
            "edge-only": first[0]["usd_per_camera_h"],
            "cloud-only": first[1]["usd_per_camera_h"],
        }
        plot_sweep(
            plot,
            sweeps,
            costs,
            f"EdgeLoop hybrid: {streams[drifts[0]]['models']} models,"
            f" {prices.camera_fps:g} fps cameras, audit {audit_share:.0%}",
        )
        report["plot"] = str(plot)
    return report


def print_cost(report: dict[str, Any], console: Console) -> None:
    """The three-way table per stream, the sweep, and the inputs with their sources."""
    for name, rows in report["tables"].items():
        table = Table(title=f"processing location, {name} stream (per camera-hour)")
        for head in (
            "location", "answer p50 ms", "answer p99 ms", "verified share",
            "verified p50 ms", "verified p99 ms", "accuracy", "edge $", "cloud $",
            "transfer $", "total $/cam-h", "uplink MB/cam-h",
        ):  # fmt: skip
            table.add_column(head, justify="right")
        for r in rows:

            def ms(v: float | None) -> str:
                return "-" if v is None else f"{v:.1f}"

            table.add_row(
                r["location"],
                ms(r["answer_p50_ms"]),
                ms(r["answer_p99_ms"]),
                f"{100 * r['verified_share']:.1f}%",
                ms(r["verified_p50_ms"]),
                ms(r["verified_p99_ms"]),
                f"{100 * r['accuracy']:.2f}%",
                f"{r['edge_usd']:.5f}",
                f"{r['cloud_compute_usd']:.5f}",
                f"{r['transfer_usd']:.5f}",
                f"{r['usd_per_camera_h']:.5f}",
                f"{r['uplink_gb'] * 1000:.1f}",
            )
        console.print(table)
    for name, rows in report["sweeps"].items():
        table = Table(title=f"threshold sweep, {name} stream")
        for head in ("threshold", "forwarded", "hybrid accuracy", "$/camera-h"):
            table.add_column(head, justify="right")
        for r in rows:
            table.add_row(
                f"{r['threshold']:g}",
                f"{100 * r['forwarded_share']:.1f}%",
                f"{100 * r['hybrid_accuracy']:.2f}%",
                f"{r['usd_per_camera_h']:.5f}",
            )
        console.print(table)
    console.print("[bold]measured inputs[/]")
    m = report["measured"]
    for key, source in m["sources"].items():
        console.print(f"  {key} = {m[key]}  ({source})", highlight=False)
    console.print("[bold]stated prices and assumptions[/]")
    for row in report["prices"]:
        console.print(f"  {row['name']} = {row['value']}  ({row['source']})", highlight=False)
    if "plot" in report:
        console.print(f"plot: {report['plot']}")


def parse_price_overrides(items: list[str], base: Prices | None = None) -> Prices:
    """``NAME=VALUE`` pairs applied to the stated prices."""
    base = base or Prices()
    known = set(asdict(base))
    changes: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"bad --set {item!r}: use NAME=VALUE with NAME one of {sorted(known)}")
        changes[key] = float(value)
    return replace(base, **changes)
