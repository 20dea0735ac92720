"""``edgeloop sim fleet``: a tiny fleet against the real broker and a verifier process."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from simulations.fleet import FleetConfig, FleetStep, find_knee, print_fleet, run_fleet


def _step(
    agents: int, offered: float, achieved: float, p99: float | None, lost: int = 0
) -> FleetStep:
    return FleetStep(
        agents=agents,
        rate_per_agent=1.0,
        offered_per_s=offered,
        published_per_s=offered,
        achieved_per_s=achieved,
        receipts_per_s=achieved,
        p50_ms=None if p99 is None else p99 / 3,
        p99_ms=p99,
        mean_ms=None,
        published=int(offered * 10),
        lost=lost,
        loss_share=lost / max(1, offered * 10),
        generator_cpu_cores=0.05,
        generator_lag_p99_ms=1.0,
        verifier_cpu_cores=0.5,
        broker_cpu_cores=0.1,
        window_s=10.0,
    )


def test_knee_is_the_first_step_that_stops_tracking_the_offered_load() -> None:
    steps = [_step(50, 50, 50, 80), _step(100, 100, 99, 90), _step(200, 200, 150, 300)]
    knee = find_knee(steps)
    assert knee["knee_agents"] == 200
    assert knee["last_healthy_agents"] == 100
    assert knee["last_healthy_per_s"] == 99
    assert "achieved 150/s" in knee["reason"]
    assert [s.healthy for s in steps] == [True, True, False]


def test_knee_from_the_tail_or_from_loss() -> None:
    # p99 bound: max(1 s, 5 x the first step's 80 ms) = 1 s.
    tail = [_step(50, 50, 50, 80), _step(100, 100, 100, 1500)]
    assert find_knee(tail)["knee_agents"] == 100
    lossy = [_step(50, 50, 50, 80), _step(100, 100, 100, 200, lost=3)]
    assert "3 samples" in find_knee(lossy)["reason"]
    fine = [_step(50, 50, 50, 80), _step(100, 100, 100, 200)]
    assert find_knee(fine)["knee_agents"] is None


def test_a_passing_hiccup_below_the_last_healthy_step_is_not_the_knee() -> None:
    steps = [
        _step(50, 50, 50, 80),
        _step(100, 100, 100, 2000),
        _step(200, 200, 199, 300),
        _step(400, 400, 200, 9000),
    ]
    knee = find_knee(steps)
    assert knee["knee_agents"] == 400
    assert knee["last_healthy_agents"] == 200
    assert knee["unhealthy_below_knee"] == [100]


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.slow
def test_tiny_fleet_gets_every_verdict(broker: Any, database_url: str) -> None:
    config = FleetConfig(
        sizes=(3, 5),
        rate_per_agent=2.0,
        warmup_s=0.5,
        duration_s=2.0,
        drain_s=10.0,
        image_px=64,
        teacher="demo",
        broker_url=broker.url,
        database_url=database_url,
    )
    report = run_fleet(config, console=Console(file=io.StringIO()))
    steps = report["steps"]
    assert [s["agents"] for s in steps] == [3, 5]
    for step in steps:
        assert step["published"] >= step["agents"] * 4  # 2/s for 2.5 s
        assert step["lost"] == 0
        assert step["achieved_per_s"] > 0
        assert step["p50_ms"] is not None and step["p99_ms"] >= step["p50_ms"]
        assert step["generator_cpu_cores"] > 0
    assert report["storage"]["samples_stored"] == sum(s["published"] for s in steps)
    assert report["storage"]["verdicts_stored"] == report["storage"]["samples_stored"]
    out = io.StringIO()
    print_fleet(report, Console(file=out, width=160))
    assert "fleet load" in out.getvalue()
