"""Distillation jobs and schedules over REST, on both databases."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see test_api.py: Starlette's TestClient warning
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def client(make_settings, database_url) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = make_settings(
        database_url=database_url, admin_token="test-admin-token", rollout_tick_s=0
    )
    with TestClient(create_app(settings, announcer=MemoryAnnouncer())) as test_client:
        yield test_client


def test_jobs_need_the_admin_token(client: TestClient) -> None:
    assert client.get("/v1/jobs").status_code == 401
    assert client.post("/v1/schedules", json={}).status_code == 401


def test_run_list_show_logs_cancel(client: TestClient) -> None:
    made = client.post(
        "/v1/jobs", json={"fleet": "plant-3", "params": {"epochs": 3}}, headers=ADMIN
    )
    assert made.status_code == 201, made.text
    job = made.json()
    assert job["state"] == "queued" and job["params"] == {"epochs": 3, "fleet": "plant-3"}
    listed = client.get("/v1/jobs", params={"state": "queued"}, headers=ADMIN).json()
    assert [j["id"] for j in listed] == [job["id"]]
    shown = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert shown["metrics"] == {} and shown["percent"] == 0.0
    logs = client.get(f"/v1/jobs/{job['id']}/logs", headers=ADMIN).json()
    assert logs[0]["message"].startswith("queued")
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert cancelled.json()["state"] == "cancelled"
    again = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    assert client.get("/v1/jobs/999", headers=ADMIN).status_code == 404
    bad = client.get("/v1/jobs", params={"state": "sleeping"}, headers=ADMIN)
    assert bad.status_code == 422 and "unknown job state" in bad.json()["detail"]


def test_bad_parameters_get_clear_errors(client: TestClient) -> None:
    bad = client.post("/v1/jobs", json={"fleet": "a", "params": {"threads": 0}}, headers=ADMIN)
    assert bad.status_code == 422 and "'threads' must be in [1, 256]" in bad.json()["detail"]
    cron = client.post(
        "/v1/schedules",
        json={"name": "n", "fleet": "a", "kind": "cron", "expression": "0 25 * * *"},
        headers=ADMIN,
    )
    assert cron.status_code == 422
    assert "bad hour field '25': values must be in 0-23" in cron.json()["detail"]


def test_schedules_crud_enable_disable_run_now(client: TestClient) -> None:
    made = client.post(
        "/v1/schedules",
        json={
            "name": "drift",
            "fleet": "plant-3",
            "kind": "trigger",
            "expression": "drift",
            "trigger": {"max_disagreement": 0.3},
            "params": {"epochs": 2},
        },
        headers=ADMIN,
    )
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    assert made.json()["trigger"] == {"max_disagreement": 0.3, "window_s": 900, "min_samples": 30}
    dup = client.post(
        "/v1/schedules",
        json={"name": "drift", "fleet": "plant-3", "kind": "interval", "expression": "60"},
        headers=ADMIN,
    )
    assert dup.status_code == 409
    off = client.patch(f"/v1/schedules/{sid}", json={"enabled": False}, headers=ADMIN)
    assert off.json()["enabled"] is False
    run = client.post(f"/v1/schedules/{sid}/run", headers=ADMIN)
    assert run.status_code == 201 and run.json()["schedule_id"] == sid
    assert (
        client.get(f"/v1/schedules/{sid}", headers=ADMIN).json()["last_job_id"] == run.json()["id"]
    )
    assert [s["name"] for s in client.get("/v1/schedules", headers=ADMIN).json()] == ["drift"]
    assert client.delete(f"/v1/schedules/{sid}", headers=ADMIN).status_code == 204
    assert client.get(f"/v1/schedules/{sid}", headers=ADMIN).status_code == 404
