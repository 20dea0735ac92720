"""Canary rollouts on both databases: cohorts, automatic abort and promotion, manual paths."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cloud_service import rollout
from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app
from cloud_service.db import crud
from edge_agent.testing import make_tiny_student
from shared.messages import AgentStatus, ModelStatus, verify_manifest_bytes
from shared.topics import Topics

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see test_api.py
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

ADMIN = {"Authorization": "Bearer test-admin-token"}
TOPICS = Topics()
FLEET = "fleet-a"
AGENTS = [f"cam-{i}" for i in range(10)]


@pytest.fixture
def announcer() -> MemoryAnnouncer:
    return MemoryAnnouncer()


@pytest.fixture
def client(make_settings, database_url, announcer, tmp_path: Path) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = make_settings(
        database_url=database_url, admin_token="test-admin-token", rollout_tick_s=0
    )
    with TestClient(create_app(settings, announcer=announcer)) as test_client:
        for version in ("v1", "v2"):
            path = make_tiny_student(tmp_path / f"{version}.onnx", size=16, version=version)
            test_client.post(
                "/v1/models",
                files={"file": (path.name, path.read_bytes(), "application/octet-stream")},
                headers=ADMIN,
            ).raise_for_status()
        test_client.post(
            "/v1/models/tiny-student/v1/promote", json={"fleet": FLEET}, headers=ADMIN
        ).raise_for_status()
        for agent in AGENTS:
            heartbeat(test_client, agent, "v1", agreement=0.9, p99=10.0)
        yield test_client


def heartbeat(
    client: TestClient, agent: str, version: str, *, agreement: float, p99: float
) -> None:
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.record_agent_status(
            session=session,
            status=AgentStatus(
                fleet=FLEET,
                agent=agent,
                state="online",
                sent_at=datetime.now(UTC),
                model_version=version,
                agreement_rate=agreement,
                latency_p99_ms=p99,
            ),
        )


def model_status(client: TestClient, agent: str, state_: str, reason: str | None = None) -> None:
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.record_model_status(
            session=session,
            status=ModelStatus(
                fleet=FLEET,
                agent=agent,
                model_name="tiny-student",
                model_version="v2",
                state=state_,  # type: ignore[arg-type]
                reason=reason,
                at=datetime.now(UTC),
            ),
        )


def start(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post(
        "/v1/rollouts",
        json={"fleet": FLEET, "name": "tiny-student", "version": "v2", **body},
        headers=ADMIN,
    )
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def tick(client: TestClient, *, after_s: float = 0.0) -> list[tuple[int, str]]:
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        return rollout.tick(
            session=session,
            announcer=state.announcer,
            topics=TOPICS,
            key=state.signing_key,
            now=datetime.now(UTC) + timedelta(seconds=after_s),
        )


def test_cohort_by_percentage_is_deterministic() -> None:
    first = rollout.choose_cohort(AGENTS, fleet=FLEET, version="v2", percent=30)
    assert first == rollout.choose_cohort(
        list(reversed(AGENTS)), fleet=FLEET, version="v2", percent=30
    )
    assert 1 <= len(first) <= 6
    assert rollout.choose_cohort(AGENTS, fleet=FLEET, version="v2", percent=100) == sorted(AGENTS)
    assert len(rollout.choose_cohort(AGENTS[:1], fleet=FLEET, version="v2", percent=1)) == 1


def test_auto_promote_after_a_clean_window(client: TestClient, announcer: MemoryAnnouncer) -> None:
    created = start(
        client,
        percent=30,
        criteria={"window_s": 60, "min_agreement": 0.8, "max_latency_ratio": 2.0, "min_samples": 1},
    )
    cohort = created["cohort"]
    assert created["baseline_version"] == "v1" and cohort
    key = client.app.state.edgeloop.signing_key.public_key_b64  # type: ignore[attr-defined]
    for agent in cohort:
        raw = announcer.retained[TOPICS.agent_models(FLEET, agent)]
        assert verify_manifest_bytes(raw, key).version == "v2"
    assert tick(client) == [(created["id"], "continue")]  # no cohort report yet
    for agent in cohort:
        model_status(client, agent, "active")
        heartbeat(client, agent, "v2", agreement=0.92, p99=12.0)
    assert tick(client) == [(created["id"], "continue")]  # inside the window
    assert tick(client, after_s=61) == [(created["id"], "promote")]
    shown = client.get(f"/v1/rollouts/{created['id']}", headers=ADMIN).json()
    assert shown["state"] == "promoted" and [e["kind"] for e in shown["events"]] == [
        "created",
        "promoted",
    ]
    fleet_raw = announcer.retained[TOPICS.fleet_models(FLEET)]
    assert verify_manifest_bytes(fleet_raw, key).version == "v2"
    assert not any(TOPICS.agent_models(FLEET, a) in announcer.retained for a in cohort)


@pytest.mark.parametrize("breach", ["refusals", "agreement", "latency"])
def test_automatic_abort_rolls_the_cohort_back(
    client: TestClient, announcer: MemoryAnnouncer, breach: str
) -> None:
    cohort = ["cam-1", "cam-2"]
    created = start(
        client,
        agents=cohort,
        criteria={
            "window_s": 600,
            "min_agreement": 0.8,
            "max_error_rate": 0.0,
            "max_latency_ratio": 2.0,
        },
    )
    if breach == "refusals":
        model_status(client, "cam-1", "rejected", "golden_mismatch: golden[0] differs")
    else:
        model_status(client, "cam-1", "active")
        agreement, p99 = (0.5, 10.0) if breach == "agreement" else (0.95, 45.0)
        heartbeat(client, "cam-1", "v2", agreement=agreement, p99=p99)
    assert tick(client) == [(created["id"], "abort")]
    shown = client.get(f"/v1/rollouts/{created['id']}", headers=ADMIN).json()
    assert shown["state"] == "aborted" and shown["reason"].startswith("automatic abort")
    expected = {"refusals": "error rate", "agreement": "agreement", "latency": "latency"}[breach]
    assert expected in shown["reason"]
    for agent in cohort:  # overrides withdrawn: back to the fleet's v1
        assert (TOPICS.agent_models(FLEET, agent), b"") in announcer.published
        assert TOPICS.agent_models(FLEET, agent) not in announcer.retained
    assert client.get("/v1/rollouts", headers=ADMIN).json()[0]["id"] == created["id"]


def test_window_without_reports_aborts(client: TestClient) -> None:
    created = start(client, agents=["cam-3"], criteria={"window_s": 30})
    assert tick(client, after_s=31) == [(created["id"], "abort")]


def test_manual_promote_and_abort(client: TestClient, announcer: MemoryAnnouncer) -> None:
    first = start(client, agents=["cam-1"], criteria={"window_s": 600})
    assert (
        client.post(
            "/v1/rollouts",
            json={"fleet": FLEET, "name": "tiny-student", "version": "v2", "agents": ["cam-2"]},
            headers=ADMIN,
        ).status_code
        == 409
    )
    aborted = client.post(
        f"/v1/rollouts/{first['id']}/abort", json={"reason": "operator"}, headers=ADMIN
    )
    assert aborted.status_code == 200 and aborted.json()["reason"] == "operator"
    assert client.post(f"/v1/rollouts/{first['id']}/abort", headers=ADMIN).status_code == 409
    second = start(client, agents=["cam-1"], criteria={"window_s": 600})
    promoted = client.post(f"/v1/rollouts/{second['id']}/promote", headers=ADMIN)
    assert promoted.status_code == 200 and promoted.json()["state"] == "promoted"
    assert tick(client) == []
    key = client.app.state.edgeloop.signing_key.public_key_b64  # type: ignore[attr-defined]
    assert (
        verify_manifest_bytes(announcer.retained[TOPICS.fleet_models(FLEET)], key).version == "v2"
    )
    history = client.get("/v1/rollouts", headers=ADMIN).json()
    assert [r["state"] for r in history] == ["promoted", "aborted"]
