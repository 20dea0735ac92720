"""``edgeloop sim project``: the projection's arithmetic and row bytes on the real schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from simulations.cli_sim import sim_app
from simulations.projection import (
    HostShape,
    ProjectionInputs,
    host_capacity,
    measure_row_bytes,
    project,
    status_bytes,
)

INPUTS = ProjectionInputs(
    camera_fps=10.0,
    forwarded_share=0.05,
    verifier_per_s=500.0,
    cloud_utilisation=0.5,
    envelope_bytes=3000,
    image_bytes=2500,
    sample_row_bytes=1000.0,
    verdict_row_bytes=300.0,
    verdict_bytes=400,
    heartbeat_s=15.0,
    status_bytes=350,
    receipt_flush_s=0.05,
)


def test_projection_arithmetic() -> None:
    r = project(10_000, INPUTS)
    assert r["samples_per_s"] == pytest.approx(5_000)  # 10k x 10 fps x 5%
    heartbeats = 10_000 / 15
    # In: samples + heartbeats from agents, verdicts + receipts from the verifier.
    assert r["broker_publishes_in_per_s"] == pytest.approx(5_000 * 3 + heartbeats)
    assert r["broker_messages_per_s"] == pytest.approx(2 * (15_000 + heartbeats))
    assert r["verifier_hosts"] == 20  # 5,000 / (500 x 0.5)
    assert r["db_rows_per_day"] == pytest.approx(5_000 * 86_400 * 2)
    assert r["db_bytes_per_day"] == pytest.approx(5_000 * 86_400 * 1_300)
    assert r["blob_bytes_per_day"] == pytest.approx(5_000 * 86_400 * 2_500)
    big = project(100_000, INPUTS)
    assert big["samples_per_s"] == pytest.approx(10 * r["samples_per_s"])
    assert big["verifier_hosts"] == 200


def test_receipts_are_capped_by_the_flush_window() -> None:
    busy = ProjectionInputs(**{**INPUTS.__dict__, "forwarded_share": 1.0, "camera_fps": 100.0})
    r = project(1, busy)
    # 100 samples/s, but at most one receipt per 50 ms flush: 20/s.
    assert r["broker_publishes_in_per_s"] == pytest.approx(100 + 1 / 15 + 100 + 20)


def test_status_bytes_is_an_encoded_heartbeat() -> None:
    assert 150 < status_bytes() < 1000


@pytest.mark.sql
def test_row_bytes_on_the_real_schema(database_url: str) -> None:
    rows = measure_row_bytes(database_url, rows=300)
    assert rows["rows"] == 300
    assert rows["sample_row_bytes"] > 200
    if rows["database"] == "postgresql":
        assert rows["verdict_row_bytes"] > 50


CLOUD_COSTS = {
    "verifier_overhead_ms_per_sample_1p": 2.4,
    "decode_cpu_ms_per_sample": 0.1,
    "teacher_cpu_ms_per_sample": 7.5,
}


def test_host_capacity_is_what_its_cores_feed_or_its_teacher_infers() -> None:
    cpu_host, how = host_capacity(HostShape(16), CLOUD_COSTS)
    assert cpu_host == pytest.approx(16_000 / 10.0)  # every cost on the CPU
    assert "teacher on the CPU" in how
    fed, _ = host_capacity(HostShape(16, teacher_per_s=50_000), CLOUD_COSTS)
    assert fed == pytest.approx(16_000 / 2.5)  # the cores starve the accelerator
    bound, _ = host_capacity(HostShape(16, teacher_per_s=3_000), CLOUD_COSTS)
    assert bound == 3_000  # the accelerator is the limit
    lean = {**CLOUD_COSTS, "verifier_overhead_ms_per_sample_1p": 0.4}
    assert host_capacity(HostShape(16, 50_000), lean)[0] == pytest.approx(32_000)
    with pytest.raises(KeyError, match="make bench"):
        host_capacity(HostShape(16), {"decode_cpu_ms_per_sample": 0.1})


def _bench_file(tmp_path: Path, cloud: dict[str, float] | None = None) -> Path:
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "started_at": "T1",
                "sections": {
                    "agent": {
                        "figures": {
                            "reference student int8": {
                                "video_p50_ms": 2.4,
                                "video_p99_ms": 6.6,
                                "video_fps": 930.0,
                            }
                        }
                    },
                    "cloud": {
                        "figures": {
                            "e2e_samples_per_s": 400.0,
                            "capture_to_verdict_p50_ms": 30.0,
                            "capture_to_verdict_p99_ms": 110.0,
                            **(cloud or {}),
                        }
                    },
                    "envelope": {
                        "figures": {"64px": {"envelope_bytes": 2978, "image_bytes": 2501}}
                    },
                },
            }
        )
    )
    return bench


def _project(tmp_path: Path, bench: Path, *extra: str) -> Any:
    return CliRunner().invoke(
        sim_app,
        [
            "project",
            "--json",
            "--cameras",
            "10000",
            "--forward-share",
            "0.05",
            "--bench",
            str(bench),
            "--database-url",
            f"sqlite:///{tmp_path / 'rows.db'}",
            "--rows",
            "200",
            *extra,
        ],
    )


def test_project_command_prints_json(tmp_path: Path) -> None:
    result = _project(tmp_path, _bench_file(tmp_path))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    row = report["projection"][0]
    assert row["samples_per_s"] == pytest.approx(5_000)
    assert row["verifier_hosts"] == 18  # 5,000 / (400 x 0.7)
    assert report["inputs"]["image_bytes"] == 2501
    assert "run T1" in report["sources"]["image_bytes"]


def test_project_for_a_stated_host_shape(tmp_path: Path) -> None:
    bench = _bench_file(tmp_path, CLOUD_COSTS)
    args = ("--host-cores", "16", "--host-teacher-per-s", "50000")
    result = _project(tmp_path, bench, *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["inputs"]["verifier_per_s"] == pytest.approx(6_400)
    assert report["projection"][0]["verifier_hosts"] == 2  # 5,000 / (6,400 x 0.7)
    assert "2.4 ms verifier" in report["sources"]["verifier_per_s"]
    assert "16 cores" in report["verifier_note"]


def test_project_refuses_a_host_shape_without_the_verifier_figures(tmp_path: Path) -> None:
    result = _project(tmp_path, _bench_file(tmp_path), "--host-cores", "16")
    assert result.exit_code != 0
    assert "make bench" in result.output
    alone = _project(tmp_path, _bench_file(tmp_path), "--host-teacher-per-s", "100")
    assert alone.exit_code != 0
    assert "--host-cores" in alone.output
