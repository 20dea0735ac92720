"""``make bench``'s detector section on the quick pair: JSON, goals, the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.detectors import run


@pytest.mark.slow
def test_detector_bench_quick_run_is_json_with_its_goals_and_table(
    quick_detectors: Any, model_cache: Path
) -> None:
    result = run(quick=True, cache_dir=model_cache)
    json.dumps(result)  # JSON-able as bench/run.py writes it
    assert result["name"] == "detectors" and result["quick"] is True
    figures = result["figures"]
    assert set(figures["latency_ms"]) == {"1", "8"}
    assert set(figures["latency_ms"]["8"]) == {"student_int8", "student_fp32", "teacher_fp32"}
    assert figures["student_int8_map50"] == quick_detectors.metrics["student"]["int8_test"]["map50"]
    assert [g["goal"] for g in result["goals"]] == [
        "detector INT8 mAP@0.5 drop (points)",
        "detector INT8 / FP32 speed, batch 8, one thread",
    ]
    (table,) = result["tables"]
    assert table.startswith("| model |") and "student INT8" in table
