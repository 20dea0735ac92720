"""``edgeloop demo`` / ``edgeloop loop``: the closed loop end to end with the quick models.

Real embedded broker, verifier, REST API, distill worker and edge agents; drift, the
trigger, one job, delivery over HTTP, and the HTML report.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from distill.scenario import ScenarioConfig, render_split
from shared.settings import EdgeLoopSettings
from simulations.closed_loop import split_pool
from simulations.demo import run_demo
from simulations.report import render_report

pytestmark = pytest.mark.mqtt


def test_pools_share_no_scan() -> None:
    pool = render_split("stream", ScenarioConfig(train_renders=2, eval_renders=1, stream_renders=1))
    live, evaluation = split_pool(pool)
    assert len(live) + len(evaluation) == len(pool)
    assert live.sources is not None and evaluation.sources is not None
    assert not set(live.sources.tolist()) & set(evaluation.sources.tolist())
    assert abs(len(live) - len(evaluation)) <= len(pool) // 5


@pytest.fixture(scope="module")
def loop_run(
    quick_models: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("demo")
    settings = EdgeLoopSettings.load(data_dir=out / "data")
    buffer = io.StringIO()
    report = run_demo(
        settings,
        quick=True,
        frames=80,
        agents=2,
        drift="blur:1.0",
        threshold=0.9,
        out_dir=out,
        console=Console(file=buffer, width=120),
        models=quick_models,
    )
    return report, out, buffer.getvalue()


def test_demo_runs_the_closed_loop(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    report, _, text = loop_run
    # Drift made the serving student worse and less sure, and the trigger noticed.
    assert report["drifted"]["edge_accuracy"] < report["before"]["edge_accuracy"]
    assert report["drifted"]["forward_rate"] > report["before"]["forward_rate"]
    assert report["trigger_fired"]
    job = report["job"]
    assert job is not None and job["state"] == "succeeded", job
    # Every live frame the agents forwarded came back with the cloud's verdict.
    for phase in ("live_before", "live_drifted", "after"):
        row = report[phase]
        assert row["frames"] == 2 * 80
        assert row["verdicts"] == round(row["forward_rate"] * row["frames"])
        assert row["verdicts_missing"] == 0
    # Measured phases send nothing and so have no verdicts.
    assert report["before"]["verdicts"] == 0 and report["drifted"]["verdicts"] == 0
    if job["gate"]["passed"]:
        # Delivered over the real path: announcement, HTTP download, checks, swap.
        assert report["delivered"]
        assert set(report["agents_on"].values()) == {job["version"]}
        served = {row[3] for row in report["timeline"]["frames"]}
        assert served == {report["serving_version"], job["version"]}
    else:
        assert set(report["agents_on"].values()) == {report["serving_version"]}
    assert "closed loop" in text and "round" in text


def test_demo_writes_the_report(loop_run: tuple[dict[str, Any], Path, str]) -> None:
    report, out, text = loop_run
    page = (out / "loop.html").read_text()
    assert str((out / "loop.html").resolve()) in text.replace("\n", "")
    assert (out / "loop.svg").is_file()
    for plot in ("accuracy", "forward", "latency"):
        assert f'id="plot-{plot}"' in page
    assert page.count("<svg") == 3 and page.count("<polyline") >= 4
    # Each plot marks when each model version first answered a frame.
    versions = {v for _, _, v in report["timeline"]["versions"]}
    assert report["serving_version"] in versions
    for version in versions:
        assert page.count(f'data-version="{version}"') == 3
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")
    # The headline table carries the measured figures.
    drifted = f"{100 * report['drifted']['edge_accuracy']:.1f}%"
    assert re.search(r'<table id="headline">.*' + re.escape(drifted), page, re.S)


def test_report_marks_each_version_and_the_round() -> None:
    frames = [
        (
            0.1 * n,
            "clean" if n < 100 else "after one round",
            "cam-1",
            "ref" if n < 100 else "d1.1",
            int(n % 3 != 0),
            int(n % 4 == 0),
            1.0,
        )
        for n in range(200)
    ]
    row = {
        "edge_accuracy": 0.9,
        "forward_rate": 0.2,
        "hybrid_accuracy": 0.95,
        "teacher_only_accuracy": 0.96,
        "uplink_share": 0.2,
    }
    report = {
        "drift": "blur:0.8",
        "agents": 1,
        "frames_per_phase": 100,
        "quick": True,
        "serving_version": "ref",
        "agents_on": {"cam-1": "d1.1"},
        "round_s": 3.0,
        "job_wall_s": 2.5,
        "wall_s": 25.0,
        "before": row,
        "drifted": row,
        "after": row,
        "after_clean": row,
        "goals": {"forward_le_25pct": True, "uplink_le_10pct": False},
        "job": {"version": "d1.1"},
        "timeline": {
            "frames": frames,
            "verdicts": [(n, 0.1 * n + 0.05, 12.0) for n in range(0, 200, 4)],
            "versions": [(0, "cam-1", "ref"), (100, "cam-1", "d1.1")],
            "spans": [
                ("clean", 0, 100, 0.0, 9.9),
                ("distillation round", 100, 100, 9.9, 52.0),
                ("after one round", 100, 200, 52.0, 62.0),
            ],
            "marks": [(50, "drift starts")],
        },
    }
    page = render_report(report)
    assert page.count('data-version="d1.1"') == 3
    assert page.count('data-version="ref"') == 3
    assert page.count("distillation round, 42 s") == 3
    assert 'class="fail">uplink_le_10pct' in page
    # Lines break between phases: two segments per series.
    assert page.count("<title>edge top-1</title>") == 2
