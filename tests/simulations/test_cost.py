"""``edgeloop sim cost``: the cost model on fixed inputs, the accuracy curve, the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulations.cost import (
    Measured,
    Prices,
    ThresholdPoint,
    accuracy_curve,
    cost_table,
    load_measured,
    parse_price_overrides,
    sweep_costs,
)

MEASURED = Measured(
    edge_p50_ms=2.0,
    edge_p99_ms=6.0,
    edge_capacity_fps=1000.0,
    verifier_per_s=500.0,
    verifier_kind="cpu",
    cloud_p50_ms=30.0,
    cloud_p99_ms=110.0,
    envelope_bytes=3000,
    verdict_bytes=400,
)
PRICES = Prices(
    cloud_cpu_usd_per_h=0.1,
    edge_device_usd=730.0,
    edge_device_months=10.0,  # 0.1 $/h
    edge_device_watts=0.0,
    site_uplink_usd_per_gb=1.0,
    cloud_egress_usd_per_gb=0.0,
    camera_fps=10.0,
    edge_utilisation=0.5,  # 1000 fps x 0.5 / 10 fps = 50 cameras per device
    cloud_utilisation=1.0,
    wan_rtt_ms=40.0,
)


def test_accuracy_curve_runs_from_edge_only_to_cloud_only() -> None:
    confidence = np.array([0.2, 0.5, 0.7, 0.95])
    student = np.array([False, True, False, True])
    teacher = np.array([True, True, True, True])
    points = accuracy_curve(confidence, student, teacher, (0.0, 0.6, 1.01), audit_share=0.0)
    assert [p.forwarded_share for p in points] == [0.0, 0.5, 1.0]
    assert [p.hybrid_accuracy for p in points] == [0.5, 0.75, 1.0]
    assert points[0].edge_accuracy == 0.5 and points[0].teacher_accuracy == 1.0
    audited = accuracy_curve(confidence, student, teacher, (0.0,), audit_share=0.1)[0]
    assert audited.forwarded_share == pytest.approx(0.1)
    assert audited.hybrid_accuracy == pytest.approx(0.5 * 0.9 + 1.0 * 0.1)


def test_cost_table_arithmetic() -> None:
    point = ThresholdPoint(0.6, 0.1, 0.98, 0.95, 0.99)
    edge, cloud, hybrid = cost_table(MEASURED, PRICES, point)
    assert edge["edge_usd"] == pytest.approx(0.1 / 50)
    assert edge["cameras_per_edge_device"] == 50
    assert edge["usd_per_camera_h"] == pytest.approx(0.002)
    # Cloud-only: 10 frames/s of 500/s per 0.1 $/h host; 10 x 3600 x 3000 B = 0.108 GB at 1 $/GB.
    assert cloud["cloud_compute_usd"] == pytest.approx(10 / 500 * 0.1)
    assert cloud["uplink_gb"] == pytest.approx(0.108)
    assert cloud["transfer_usd"] == pytest.approx(0.108)
    assert cloud["answer_p50_ms"] == 70.0 and cloud["answer_p99_ms"] == 150.0
    assert cloud["accuracy"] == 0.99
    # Hybrid: the edge device plus a tenth of the cloud's compute and transfer.
    assert hybrid["usd_per_camera_h"] == pytest.approx(0.002 + 0.1 * (0.002 + 0.108))
    assert hybrid["answer_p50_ms"] == 2.0 and hybrid["verified_p99_ms"] == 150.0
    assert hybrid["accuracy"] == 0.98
    gpu = cost_table(Measured(**{**MEASURED.__dict__, "verifier_kind": "gpu"}), PRICES, point)[1]
    assert gpu["cloud_compute_usd"] == pytest.approx(10 / 500 * PRICES.cloud_gpu_usd_per_h)


def test_sweep_cost_grows_with_the_forwarded_share() -> None:
    points = [ThresholdPoint(t, s, 0.9, 0.9, 0.99) for t, s in ((0.3, 0.01), (0.9, 0.3))]
    rows = sweep_costs(MEASURED, PRICES, points)
    assert rows[0]["usd_per_camera_h"] < rows[1]["usd_per_camera_h"]


def _bench(path: Path, when: str, sections: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"started_at": when, "sections": sections}))
    return path


def test_measured_inputs_come_from_the_bench_with_sources(tmp_path: Path) -> None:
    agent = {"reference student int8": {"video_p50_ms": 2.4, "video_p99_ms": 6.6, "video_fps": 930}}
    cloud = {
        "e2e_samples_per_s": 449.0,
        "e2e_database": "postgresql",
        "capture_to_verdict_p50_ms": 30.1,
        "capture_to_verdict_p99_ms": 114.1,
        "latency_rate_per_s": 224.4,
    }
    envelope = {"64px": {"envelope_bytes": 2978, "image_bytes": 2501}}
    full = _bench(
        tmp_path / "full.json",
        "T1",
        {
            "agent": {"figures": agent},
            "cloud": {"figures": {**cloud, "e2e_samples_per_s": 1.0}},
            "envelope": {"figures": envelope},
        },
    )
    newer = _bench(tmp_path / "latest.json", "T2", {"cloud": {"figures": cloud}})
    measured = load_measured([newer, full])
    assert measured.verifier_per_s == 449.0  # the first file that has the section wins
    assert measured.edge_p50_ms == 2.4 and measured.envelope_bytes == 2978
    assert "run T2" in measured.sources["verifier_per_s"]
    assert "run T1" in measured.sources["edge_p50_ms"]
    assert measured.verdict_bytes > 100
    with pytest.raises(KeyError, match="agent"):
        load_measured([newer])
    # An agent section run without the reference classifier pair says how to get it.
    unbuilt = _bench(
        tmp_path / "unbuilt.json",
        "T3",
        {"agent": {"figures": {"tiny-student 224px": {"video_fps": 300}}}},
    )
    with pytest.raises(KeyError, match="edgeloop models bootstrap"):
        load_measured([unbuilt, full])
    fleet = {
        "teacher": "t",
        "knee": {"last_healthy_per_s": 123.0, "last_healthy_agents": 200},
        "steps": [{"healthy": True, "agents": 200, "p50_ms": 40.0, "p99_ms": 90.0}],
    }
    from_fleet = load_measured([newer, full], fleet_report=fleet)
    assert from_fleet.verifier_per_s == 123.0 and from_fleet.cloud_p99_ms == 90.0


def test_price_overrides() -> None:
    assert parse_price_overrides(["camera_fps=5"]).camera_fps == 5.0
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_price_overrides(["nope=1"])


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from simulations.cost import plot_sweep

    points = [ThresholdPoint(t, t / 2, 0.9 + t / 20, 0.9, 0.99) for t in (0.0, 0.5, 1.0)]
    sweep = sweep_costs(MEASURED, PRICES, points)
    path = plot_sweep(
        tmp_path / "c.png", {"clean": sweep}, {"edge-only": 0.002, "cloud-only": 0.1}, "t"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
