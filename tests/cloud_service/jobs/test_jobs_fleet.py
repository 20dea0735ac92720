"""Jobs take a fleet, their parameters are documented, workers register so a queue with
nobody to take it shows (functions, REST, /metrics, CLI); on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.params import JobParams
from cloud_service.jobs.worker import DistillWorker, JobContext, JobOutcome
from cloud_service.settings import CloudSettings
from shared.errors import ContractError
from simulations.cli import app as edgeloop

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see test_api.py: Starlette's TestClient warning
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql
ADMIN = {"Authorization": "Bearer test-admin-token"}
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def said(result: Any) -> str:
    """A command's output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def _token(sessions: sessionmaker[Session], fleet: str) -> None:
    with sessions.begin() as s:
        crud.create_enrollment_token(session=s, fleet=fleet, agent_id=None, ttl_s=3600)


def test_the_fleet_defaults_to_the_only_known_one(sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        with pytest.raises(ContractError, match="no fleet is known yet"):
            jobs.resolve_fleet(session=s, fleet=None)
        assert jobs.resolve_fleet(session=s, fleet="plant-9") == "plant-9"
        with pytest.raises(ContractError, match="fleet"):
            jobs.resolve_fleet(session=s, fleet="Plant 9")
    _token(sessions, "plant-3")
    with sessions() as s:
        assert jobs.resolve_fleet(session=s, fleet=None) == "plant-3"
    _token(sessions, "dock-1")
    with sessions() as s:
        assert jobs.known_fleets(session=s) == ["dock-1", "plant-3"]
        with pytest.raises(ContractError, match=r"2 fleets are known.*dock-1, plant-3"):
            jobs.resolve_fleet(session=s, fleet=None)
    with pytest.raises(ContractError, match="'fleet'"):
        jobs.validate_params({"fleet": "no/slashes"})


def test_every_parameter_is_documented_once_with_the_pipelines_default() -> None:
    docs = {row["name"]: row for row in jobs.job_parameter_docs()}
    assert set(docs) == {f.name for f in fields(JobParams)}
    assert docs["epochs"] == {
        "name": "epochs",
        "type": "int",
        "default": JobParams.epochs,
        "range": "1..200",
        "meaning": "training epochs (one-cycle schedule)",
    }
    assert docs["lr"]["type"] == "number" and docs["quick"]["type"] == "bool"
    assert all(row["meaning"] for row in docs.values())


def test_a_worker_counts_as_live_until_three_beats_are_missed(
    sessions: sessionmaker[Session],
) -> None:
    now = [T0]
    worker = DistillWorker(
        sessions,
        runner=lambda ctx: JobOutcome(),
        owner="w1",
        beat_s=10.0,
        clock=lambda: now[0],
    )
    with sessions.begin() as s:
        jobs.enqueue(session=s, params={"fleet": "a"}, now=T0)
    with sessions() as s:
        status = jobs.queue_status(session=s, now=T0)
    assert (status.queued, status.live_workers, status.waiting_without_worker) == (1, 0, 1)
    assert status.warning and "no distill worker is running" in status.warning

    worker.beat()
    with sessions() as s:
        assert jobs.queue_status(session=s, now=T0 + timedelta(seconds=29)).live_workers == 1
        late = jobs.queue_status(session=s, now=T0 + timedelta(seconds=31))
    assert late.live_workers == 0 and late.waiting_without_worker == 1

    now[0] = T0 + timedelta(seconds=5)
    worker.beat()  # within beat_s: nothing written
    now[0] = T0 + timedelta(seconds=25)
    worker.beat()
    with sessions() as s:
        assert jobs.queue_status(session=s, now=T0 + timedelta(seconds=50)).live_workers == 1
        [row] = jobs.live_workers(session=s, now=T0 + timedelta(seconds=50))
    assert row.owner == "w1" and row.heartbeat_at == T0 + timedelta(seconds=25)

    worker.unregister()  # a clean stop
    with sessions() as s:
        assert jobs.queue_status(session=s, now=T0 + timedelta(seconds=26)).live_workers == 0


def test_a_failed_job_logs_its_reason_not_a_traceback(sessions: sessionmaker[Session]) -> None:
    def boom(ctx: JobContext) -> JobOutcome:
        raise KeyError("holdout")

    with sessions.begin() as s:
        job_id = jobs.enqueue(session=s, params={"fleet": "a"}).id
    DistillWorker(sessions, runner=boom).run_once()
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        lines = [line.message for line in jobs.read_logs(session=s, job_id=job_id)]
    assert job.state == "failed" and job.error == "KeyError: 'holdout'"
    assert lines[-1] == "failed: KeyError: 'holdout'"
    assert not any("Traceback" in line or 'File "' in line for line in lines)


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = CloudSettings(
        data_dir=tmp_path,
        database_url=database_url,
        admin_token="test-admin-token",
        rollout_tick_s=0,
        blob_fsync=False,
    )
    with TestClient(create_app(settings, announcer=MemoryAnnouncer())) as test_client:
        yield test_client


def test_the_api_takes_a_fleet_and_tells_a_queue_without_workers(client: TestClient) -> None:
    none = client.post("/v1/jobs", json={"params": {"epochs": 2}}, headers=ADMIN)
    assert none.status_code == 422 and "no fleet is known yet" in none.json()["detail"]
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    _token(state.sessions, "plant-3")
    assert client.get("/v1/fleets", headers=ADMIN).json() == ["plant-3"]
    made = client.post("/v1/jobs", json={"params": {"epochs": 2}}, headers=ADMIN)
    assert made.status_code == 201 and made.json()["params"]["fleet"] == "plant-3"
    clash = client.post("/v1/jobs", json={"fleet": "a", "params": {"fleet": "b"}}, headers=ADMIN)
    assert clash.status_code == 422 and "disagree" in clash.json()["detail"]
    schedule = client.post(
        "/v1/schedules",
        json={"name": "hourly", "kind": "interval", "expression": "3600", "fleet": "dock-1"},
        headers=ADMIN,
    )
    assert schedule.status_code == 201 and schedule.json()["params"] == {"fleet": "dock-1"}

    queue = client.get("/v1/jobs/queue", headers=ADMIN).json()
    assert queue["queued"] == 1 and queue["live_workers"] == 0
    assert queue["waiting_without_worker"] == 1 and "no distill worker" in queue["warning"]
    metrics = client.get("/metrics").text
    assert "edgeloop_distill_jobs_queued 1.0" in metrics
    assert "edgeloop_distill_workers_live 0.0" in metrics
    assert "edgeloop_distill_jobs_waiting_without_worker 1.0" in metrics

    with state.sessions.begin() as s:
        jobs.beat_worker(session=s, owner="w", host="h", pid=1, ttl_s=60)
    metrics = client.get("/metrics").text
    assert "edgeloop_distill_workers_live 1.0" in metrics
    assert "edgeloop_distill_jobs_waiting_without_worker 0.0" in metrics
    params = client.get("/v1/jobs/params", headers=ADMIN).json()
    assert {"name", "type", "default", "range", "meaning"} == set(params[0])


def test_the_cli_picks_the_fleet_lists_params_and_prints_schedules_as_a_table(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGELOOP_DATABASE_URL", database_url)
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path))
    runner = CliRunner()
    upgrade_database(database_url)
    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    try:
        _token(sessions, "plant-3")
        _token(sessions, "dock-1")
        refused = runner.invoke(edgeloop, ["jobs", "run"])
        assert refused.exit_code == 2
        assert "2 fleets are known" in said(refused) and "dock-1, plant-3" in said(refused)
        ran = runner.invoke(edgeloop, ["jobs", "run", "--fleet", "plant-3", "-p", "epochs=2"])
        assert ran.exit_code == 0, ran.output
        assert "queued job 1 for fleet plant-3" in said(ran)
        assert "no distill worker is running" in said(ran)

        listed = runner.invoke(edgeloop, ["jobs", "list"])
        assert "plant-3" in said(listed) and "no distill worker is running" in said(listed)
        shown = runner.invoke(edgeloop, ["jobs", "show", "1", "--json"])
        assert "no distill worker" in json.loads(shown.output)["waiting"]

        made = runner.invoke(
            edgeloop, ["jobs", "schedule", "nightly", "--cron", "0 3 * * *", "--fleet", "dock-1"]
        )
        assert made.exit_code == 0, made.output
        table = runner.invoke(edgeloop, ["jobs", "schedules"])
        assert table.exit_code == 0, table.output
        assert "nightly" in said(table) and "dock-1" in said(table) and "cron 0 3" in said(table)
        assert "{" not in table.output and "'id'" not in table.output  # no Python dicts
        rows = json.loads(runner.invoke(edgeloop, ["jobs", "schedules", "--json"]).output)
        assert rows[0]["fleet"] == "dock-1" and rows[0]["enabled"] is True
        off = runner.invoke(edgeloop, ["jobs", "schedules", "--disable", "1", "--json"])
        assert json.loads(off.output)[0]["enabled"] is False
        gone = runner.invoke(edgeloop, ["jobs", "schedules", "--delete", "1", "--json"])
        assert json.loads(gone.output) == []

        params = runner.invoke(edgeloop, ["jobs", "params", "--json"])
        assert {row["name"] for row in json.loads(params.output)} >= {"fleet", "epochs"}
        assert "min_samples" in said(runner.invoke(edgeloop, ["jobs", "params"]))
    finally:
        engine.dispose()
