"""``edgeloop demo`` / ``edgeloop loop``: the closed loop end to end with the quick models.

Real embedded broker, verifier, REST API, distill worker and edge agents; drift, the
trigger, two rounds (the drifted stream continues and the trigger fires again), delivery
over HTTP, and the HTML report.
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
from simulations.loop_table import goal_columns, goals, table_header, table_rows
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
        rounds=2,
        job_params={"epochs": 5},
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
    # Each round ran its own job, warm-started from the student serving at the time.
    rounds = report["rounds"]
    assert [e["round"] for e in rounds] == [1, 2]
    served_by = report["serving_version"]
    expected = {served_by}
    for e in rounds:
        assert e["job"] is not None and e["job"]["state"] == "succeeded", e
        assert e["job"]["parent_version"] == served_by
        if e["job"]["gate"]["passed"]:
            # Delivered over the real path: announcement, HTTP download, checks, swap.
            assert e["delivered"]
            served_by = e["job"]["version"]
            expected.add(served_by)
        assert set(e["agents_on"].values()) == {served_by}
        assert e["after"]["frames"] == 2 * 80 and e["after_clean"]["frames"] == 2 * 80
    # Round 2 trained on frames the resumed stream forwarded, and the trigger fired again.
    assert rounds[1]["trigger_fired"] and rounds[1]["samples_new"] > 0
    assert rounds[1]["live_drifted"]["verdicts"] > 0
    # Only the last round's column is live: no evaluation frame was ever verified.
    assert rounds[0]["after"]["live"] is False and rounds[1]["after"]["live"] is True
    assert report["job"] == rounds[-1]["job"] and report["after"] == rounds[-1]["after"]
    served = {row[3] for row in report["timeline"]["frames"]}
    assert served == expected
    # The goals say which column each reads.
    columns = report["goal_columns"]
    assert columns["forward_rate_down_30pct"] == "after round 1"
    assert columns["uplink_le_10pct"] == "after round 2 (steady state)"
    assert "closed loop" in text and "round 2" in text


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
    svg = (out / "loop.svg").read_text()
    for e in report["rounds"]:
        assert f"round {e['round']}, drifted" in svg
    assert "<th>after round 1</th><th>after round 2 (steady state)</th>" in page
    assert "(after round 2 (steady state))" in page
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


def test_report_has_a_column_per_round() -> None:
    frames = [
        (
            0.1 * n,
            "drifted" if n < 100 else "after round 2",
            "cam-1",
            "a" if n < 100 else "b",
            1,
            0,
            1.0,
        )
        for n in range(200)
    ]

    def row(acc: float) -> dict[str, float]:
        return {
            "edge_accuracy": acc,
            "forward_rate": 0.1,
            "hybrid_accuracy": 0.99,
            "teacher_only_accuracy": 0.99,
            "uplink_share": 0.1,
        }

    rounds = [
        {
            "round": k,
            "after": row(a),
            "after_clean": row(0.97),
            "round_s": 1.0,
            "job_wall_s": 1.0,
            "round_wall_s": 2.0,
            "samples_new": 100,
            "job": {"version": v},
            "agents_on": {"cam-1": v},
        }
        for k, a, v in ((1, 0.91, "a"), (2, 0.93, "b"))
    ]
    report: dict[str, Any] = {
        "drift": "blur:0.8",
        "agents": 1,
        "frames_per_phase": 100,
        "quick": True,
        "serving_version": "ref",
        "agents_on": {"cam-1": "b"},
        "wall_s": 25.0,
        "before": row(0.98),
        "drifted": row(0.8),
        "after": rounds[-1]["after"],
        "after_clean": rounds[-1]["after_clean"],
        "rounds": rounds,
        "timeline": {"frames": frames, "versions": [(0, "cam-1", "a"), (100, "cam-1", "b")]},
    }
    report["goals"] = goals(report)
    report["goal_columns"] = goal_columns(report)
    # The first-round goals read round 1, the steady-state ones the last round.
    assert report["goals"]["gap_closed_share"] == round((0.91 - 0.8) / (0.98 - 0.8), 3)
    assert report["goal_columns"]["half_gap_closed"] == "after round 1"
    assert report["goal_columns"]["hybrid_ge_99pct_teacher"] == "after round 2 (steady state)"
    assert table_header(report)[2:] == ["drifted", "after round 1", "after round 2 (steady state)"]
    assert table_rows(report)[0] == ("edge acc, drifted stream", "-", "80.0%", "91.0%", "93.0%")
    page = render_report(report)
    assert page.count('data-version="b"') == 3
    assert "The distillation job, round 2" in page
