"""``edgeloop demo``: a real loop through the embedded broker, with the quick models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared.settings import EdgeLoopSettings
from simulations.demo import run_demo

pytestmark = pytest.mark.mqtt


def test_demo_answers_every_forwarded_frame(
    quick_models: Any, model_cache: Path, tmp_path: Path
) -> None:
    settings = EdgeLoopSettings.load(data_dir=tmp_path)
    report = run_demo(
        settings,
        frames=120,
        drift="blur:1.0",
        threshold=0.9,
        quick=True,
        as_json=True,
        cache_dir=model_cache,
    )
    summary = report.as_dict()
    forwarded = sum(report.forwarded.values())
    assert sum(report.frames.values()) == 120
    assert forwarded > 0
    # Every forwarded sample came back with a receipt and a verdict, none refused.
    assert sum(report.verdicts.values()) == forwarded
    assert report.receipts == forwarded
    assert report.refused == 0
    assert summary["envelope_overhead_bytes_median"] <= 512
    # The drift makes the student less sure: it forwards more once the stream drifts.
    assert report.forwarded["drift"] >= report.forwarded["clean"]
