"""The model registry over REST on both databases: register, artifacts with Range, promote,
rollback, pins, retention, and agents' refusals visible in the API."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cloud_service.announce import MemoryAnnouncer
from cloud_service.api import create_app
from cloud_service.db import crud
from edge_agent.testing import make_tiny_student
from shared.manifest import FleetSigningKey
from shared.messages import ModelStatus, verify_manifest_bytes
from shared.topics import Topics

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see test_api.py: Starlette's TestClient warning
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

ADMIN = {"Authorization": "Bearer test-admin-token"}
TOPICS = Topics()


@pytest.fixture
def announcer() -> MemoryAnnouncer:
    return MemoryAnnouncer()


@pytest.fixture
def client(make_settings, database_url, announcer) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = make_settings(
        database_url=database_url,
        admin_token="test-admin-token",
        model_retention_keep=2,
        rollout_tick_s=0,
    )
    with TestClient(create_app(settings, announcer=announcer)) as test_client:
        yield test_client


def _model(tmp_path: Path, version: str, seed: int = 0) -> Path:
    return make_tiny_student(tmp_path / f"{version}.onnx", size=16, seed=seed, version=version)


def _register(client: TestClient, path: Path) -> dict:  # type: ignore[type-arg]
    response = client.post(
        "/v1/models",
        files={"file": (path.name, path.read_bytes(), "application/octet-stream")},
        data={"metrics": '{"accuracy": 0.9}', "parent_version": "v0"},
        headers=ADMIN,
    )
    assert response.status_code == 201, response.text
    return response.json()


def _key(client: TestClient) -> FleetSigningKey:
    return client.app.state.edgeloop.signing_key  # type: ignore[attr-defined,no-any-return]


def test_register_show_and_serve_artifact_with_range(client: TestClient, tmp_path: Path) -> None:
    path = _model(tmp_path, "v1")
    body = _register(client, path)
    assert body["name"] == "tiny-student" and body["version"] == "v1"
    assert body["metrics"] == {"accuracy": 0.9} and body["parent_version"] == "v0"
    manifest = body["manifest"]
    assert manifest["input"]["shape"] == ["batch", 16, 16, 3] and manifest["opset"] == 17
    assert manifest["golden"] and manifest["url"] == "/v1/models/tiny-student/v1/artifact"
    again = client.post(
        "/v1/models",
        files={"file": (path.name, path.read_bytes(), "application/octet-stream")},
        headers=ADMIN,
    )
    assert again.status_code == 409 and "immutable" in again.json()["detail"]
    assert [m["version"] for m in client.get("/v1/models", headers=ADMIN).json()] == ["v1"]
    url = "/v1/models/tiny-student/v1/artifact"
    assert client.get(url).status_code == 401
    data = path.read_bytes()
    full = client.get(url, headers=ADMIN)
    assert full.status_code == 200 and full.content == data
    part = client.get(url, headers={**ADMIN, "Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == data[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    assert client.get(url, headers={**ADMIN, "Range": f"bytes={len(data)}-"}).status_code == 416
    # An enrolled agent's own token fetches artifacts too.
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        token, _ = crud.create_enrollment_token(
            session=session, fleet="fleet-a", agent_id="cam-1", ttl_s=600
        )
        _, api_token = crud.enroll_agent(session=session, token=token, agent_id="cam-1")
    assert client.get(url, headers={"Authorization": f"Bearer {api_token}"}).content == data
    assert client.get(url, headers={"Authorization": "Bearer ela_wrong"}).status_code == 401


def test_promote_rollback_pin_and_refusals_in_the_api(
    client: TestClient, announcer: MemoryAnnouncer, tmp_path: Path
) -> None:
    _register(client, _model(tmp_path, "v1", 1))
    _register(client, _model(tmp_path, "v2", 2))
    fleet_topic = TOPICS.fleet_models("fleet-a")
    for version in ("v1", "v2"):
        promoted = client.post(
            f"/v1/models/tiny-student/{version}/promote", json={"fleet": "fleet-a"}, headers=ADMIN
        )
        assert promoted.status_code == 200, promoted.text
    assert promoted.json()["history"] == ["v1"]
    manifest = verify_manifest_bytes(announcer.retained[fleet_topic], _key(client).public_key_b64)
    assert manifest.version == "v2"
    back = client.post("/v1/models/tiny-student/rollback", json={"fleet": "fleet-a"}, headers=ADMIN)
    assert back.status_code == 200 and back.json()["version"] == "v1"
    retained = verify_manifest_bytes(announcer.retained[fleet_topic], _key(client).public_key_b64)
    assert retained.version == "v1"
    none_left = client.post(
        "/v1/models/tiny-student/rollback", json={"fleet": "fleet-a"}, headers=ADMIN
    )
    assert none_left.status_code == 409
    pin = client.post(
        "/v1/models/tiny-student/v2/pin",
        json={"fleet": "fleet-a", "agents": ["cam-2"]},
        headers=ADMIN,
    )
    assert pin.status_code == 200
    agent_topic = TOPICS.agent_models("fleet-a", "cam-2")
    assert verify_manifest_bytes(announcer.retained[agent_topic], _key(client).public_key_b64)
    unpin = client.post(
        "/v1/models/unpin", json={"fleet": "fleet-a", "agents": ["cam-2"]}, headers=ADMIN
    )
    assert unpin.json()["unpinned"] == ["cam-2"] and agent_topic not in announcer.retained
    assert announcer.published[-1] == (agent_topic, b"")
    # An agent's refusal, as the verifier ingests it, shows on the version.
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.record_model_status(
            session=session,
            status=ModelStatus(
                fleet="fleet-a",
                agent="cam-2",
                model_name="tiny-student",
                model_version="v2",
                state="rejected",
                reason="hash_mismatch: artifact sha256 differs",
                at=datetime.now(UTC),
            ),
        )
    shown = client.get("/v1/models/tiny-student/v2", headers=ADMIN).json()
    assert shown["agent_status"][0]["reason"].startswith("hash_mismatch")
    assert client.get("/v1/agents/cam-2", headers=ADMIN).json()["model_status"]["state"] == (
        "rejected"
    )


def test_retention_keeps_newest_and_serving(client: TestClient, tmp_path: Path) -> None:
    for index in range(1, 5):
        _register(client, _model(tmp_path, f"v{index}", index))
        if index == 1:
            client.post(
                "/v1/models/tiny-student/v1/promote", json={"fleet": "fleet-a"}, headers=ADMIN
            )
    states = {m["version"]: m["state"] for m in client.get("/v1/models", headers=ADMIN).json()}
    assert states == {"v4": "registered", "v3": "registered", "v2": "deleted", "v1": "serving"}
    assert client.get("/v1/models/tiny-student/v2/artifact", headers=ADMIN).status_code == 404
    refused = client.post(
        "/v1/models/tiny-student/v2/promote", json={"fleet": "fleet-a"}, headers=ADMIN
    )
    assert refused.status_code == 409
