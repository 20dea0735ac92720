"""The detection closed loop, short: the quick detector pair, one round, its table."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from simulations.loop_detection import quick_config, run_detection_loop


def test_one_round_reports_the_table_the_gate_and_the_goals(
    quick_detectors: Any, model_cache: Path, tmp_path: Path
) -> None:
    out = io.StringIO()
    report = run_detection_loop(
        quick_config(rounds=1, round_epochs=2, drift="blur:0.5"),
        cache_dir=model_cache,
        work_dir=tmp_path / "fresh" / "data",
        console=Console(file=out, width=120),
    )
    assert report["task"] == "detection" and report["drift"] == "blur:0.5"
    before = report["table"][0]
    assert before["phase"] == "before rounds"
    for row in report["table"]:
        for key in ("edge_map50_clean", "edge_map50_drifted", "hybrid_map50_drifted"):
            assert 0.0 <= row[key] <= 1.0
        assert 0.0 <= row["forward_rate_drifted"] <= 1.0
    # The drift hurts the serving student; the teacher's answers lift the fleet's.
    assert before["edge_map50_drifted"] < before["edge_map50_clean"]
    assert before["hybrid_map50_drifted"] >= before["edge_map50_drifted"]
    (first,) = report["rounds"]
    if "skipped" not in first:
        assert first["trained_on"] > 0 and first["uplink_bytes"] > 0
        # A fifth of the round's new frames is the gate's recent data; the rest train.
        assert first["trained_on"] == first["new_frames"] - round(0.2 * first["new_frames"])
        assert first["gate"]["metric"] == "map50"
        assert set(first["evaluation_map50"]) == {"new_fp32", "new_int8", "serving"}
        assert len(report["table"]) == 2
    assert set(report["goals"]) == {
        "recovered_share_of_gap",
        "clean_drop_points",
        "hybrid_vs_teacher",
        "forward_rate",
    }
    assert "Detection closed loop" in out.getvalue()
