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

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from simulations.cost_inputs import (
    DEFAULT_BENCH,
    Measured,
    load_measured,
    measure_stream,
    merge_bench,
    reference_models,
)
from simulations.cost_report import plot_sweep, print_cost

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
    "parse_price_overrides",
    "plot_sweep",
    "print_cost",
    "run_cost",
    "sweep_costs",
]

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
class ThresholdPoint:
    """Accuracy and forwarded share of the hybrid at one confidence threshold."""

    threshold: float
    forwarded_share: float
    hybrid_accuracy: float
    edge_accuracy: float
    teacher_accuracy: float


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
    models = reference_models(console)
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
