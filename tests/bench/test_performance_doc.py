"""docs/performance.md is what the benchmark results give, never a retyped copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.report import DOC, RESULTS, load_inputs, main, render_performance
from bench.run import render_markdown


def _minimal_report(*, quick: bool) -> dict[str, Any]:
    return {
        "started_at": "2026-12-02T05:03:23+00:00",
        "machine": {"cpu": "Test CPU", "cores": 4, "python": "3.11.7", "cuda": False},
        "quick": quick,
        "sections": {"envelope": {"tables": ["| a | b |\n|---|---|\n| 1 | 2 |"], "seconds": 1.5}},
        "goals": [{"goal": "g", "measured": 0.9, "target": ">= 0.8", "status": "met"}],
    }


def _results(tmp_path: Path, report: dict[str, Any]) -> Path:
    (tmp_path / "latest.json").write_text(json.dumps(report))
    return tmp_path


def test_committed_document_is_what_the_results_give() -> None:
    rendered = render_performance(load_inputs(RESULTS))
    assert DOC.read_text() == rendered, "docs/performance.md is out of date: run `make docs`"


def test_latest_markdown_is_what_its_json_gives() -> None:
    report = json.loads((RESULTS / "latest.json").read_text())
    assert render_markdown(report) == (RESULTS / "latest.md").read_text()


def test_document_carries_host_goals_and_each_sections_tables(tmp_path: Path) -> None:
    text = render_performance(load_inputs(_results(tmp_path, _minimal_report(quick=True))))
    assert "| CPU | Test CPU, 4 logical CPUs |" in text
    assert "| mode | quick" in text
    assert "| instruction sets | not recorded" in text
    assert "| g | 0.9 | - | >= 0.8 | met |" in text
    assert "### envelope\n\nSample envelope:" in text  # the method, from bench/envelope.py
    assert "| a | b |\n|---|---|\n| 1 | 2 |" in text
    assert "## The closed loop" not in text and "## Fleet load" not in text


def test_check_tells_a_stale_document_from_a_current_one(tmp_path: Path) -> None:
    results = _results(tmp_path, _minimal_report(quick=False))
    out = tmp_path / "performance.md"
    out.write_text("# typed by hand\n")
    assert main(["--results", str(results), "--out", str(out), "--check"]) == 1
    assert out.read_text() == "# typed by hand\n"
    assert main(["--results", str(results), "--out", str(out)]) == 0
    assert main(["--results", str(results), "--out", str(out), "--check"]) == 0


def test_missing_results_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--results", str(tmp_path), "--out", str(tmp_path / "p.md")])
    assert exc.value.code == 2
    assert "latest.json does not exist: run `make bench` first" in capsys.readouterr().err


def test_results_without_a_run_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "latest.json").write_text('{"machine": {}}')
    with pytest.raises(SystemExit):
        main(["--results", str(tmp_path), "--check"])
    assert "has no 'started_at'" in capsys.readouterr().err


def test_the_fleet_projection_is_rendered_with_its_inputs_and_sources(tmp_path: Path) -> None:
    results = _results(tmp_path, _minimal_report(quick=False))
    (results / "simulations").mkdir()
    projection = {
        "projection": [
            {"cameras": 10_000, "verifier_hosts": 2, "blob_bytes_per_day": 5.5e12},
            {"cameras": 100_000, "verifier_hosts": 17, "blob_bytes_per_day": 5.5e13},
        ],
        "inputs": {"verifier_per_s": 12678.3, "forwarded_share": 0.0288},
        "sources": {"verifier_per_s": "16 cores / (0.5 ms verifier + ...) per sample"},
        "verifier_note": "verifier hosts from 12,678 samples/s per host",
    }
    (results / "simulations" / "projection.json").write_text(json.dumps(projection))
    text = render_performance(load_inputs(results))
    assert "## Fleet projection" in text
    assert "what a fleet of cameras needs, from the figures above. Verifier hosts from" in text
    assert "| | 10,000 cameras | 100,000 cameras |" in text
    assert "| verifier hosts | 2 | 17 |" in text
    assert "| blob GB/day | 5,500.0 | 55,000.0 |" in text
    assert "| samples/s forwarded | - | - |" in text  # a figure the run lacks
    assert "| verifier_per_s | 12,678 | 16 cores / (0.5 ms verifier + ...) per sample |" in text
    assert "| forwarded_share | 0.0288 | - |" in text
