from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.models import run
from distill.cache import ReferenceModels


@pytest.mark.slow
def test_bench_quick_run_is_json_and_has_tables(
    quick_models: ReferenceModels, model_cache: Path
) -> None:
    result = run(quick=True, cache_dir=model_cache)
    json.dumps(result)  # JSON-able as bench/run.py writes it
    assert result["name"] == "models" and result["quick"] is True
    assert len(result["tables"]) >= 4 and all(t.startswith("|") for t in result["tables"])
    names = [g["goal"] for g in result["goals"]]
    assert any("eager, batch 8" in n for n in names) and any("teacher top-1" in n for n in names)
    speed = result["figures"]["speed"]
    assert set(speed) == {"1", "8"} and speed["8"]["int8"]["batch"] == 8
    assert len(speed["1"]["int8"]["repeats_ms"]) == 7
