"""The registry refuses what an agent would refuse, with the reason, at upload and at
promotion; the Models page shows each agent's install state and never "serving" for a
version agents refused; the registered name and version are the ones samples carry."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cloud_service.api import create_app
from cloud_service.db import crud
from distill.model_import import ImportSpec, import_onnx
from edge_agent.agent import Agent
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher, make_tiny_student
from shared.messages import AgentStatus, ModelStatus, decode_message

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see test_api.py: Starlette's TestClient warning
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

ADMIN = {"Authorization": "Bearer test-admin-token"}
PASSWORD = "correct horse battery"
LABELS = ["a", "b", "c"]


@pytest.fixture
def client(make_settings, database_url) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    settings = make_settings(
        database_url=database_url, admin_token="test-admin-token", rollout_tick_s=0
    )
    with TestClient(create_app(settings), follow_redirects=False) as test_client:
        yield test_client


def _user_model(path: Path, size: int, *, labels_meta: list[str] | None = None) -> Path:
    """A float32 NCHW classifier with normalisation expected outside: input -> logits."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["input", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "user",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, len(LABELS)])],
        [
            numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.zeros(4, np.float32), "b"),
            numpy_helper.from_array(rng.normal(0, 1, (4, len(LABELS))).astype(np.float32), "fc"),
            numpy_helper.from_array(np.zeros(len(LABELS), np.float32), "fcb"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if labels_meta is not None:
        model.metadata_props.add(key="edgeloop.labels", value=json.dumps(labels_meta))
    onnx.save(model, str(path))
    return path


def _imported(tmp_path: Path, size: int, name: str = "user-model", version: str = "1") -> Path:
    spec = ImportSpec(
        role="student",
        labels=LABELS,
        input_name="input",
        layout="NCHW",
        dtype="float32",
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        scale=1 / 255,
        name=name,
        version=version,
    )
    source = _user_model(tmp_path / f"source-{size}.onnx", size)
    return import_onnx(source, spec, out=tmp_path / f"{name}-{version}.onnx").path


def _upload(client: TestClient, path: Path, **fields: str):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/models",
        files={"file": (path.name, path.read_bytes(), "application/octet-stream")},
        data=fields,
        headers=ADMIN,
    )


def _heartbeat(client: TestClient, agent: str, fleet: str, hw: int, model: str) -> None:
    """An agent's heartbeat as the ingest stores it: what it feeds and runs."""
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.record_agent_status(
            session=session,
            status=AgentStatus(
                fleet=fleet,
                agent=agent,
                state="online",
                sent_at=datetime.now(UTC),
                model_name=model,
                model_version="1",
                input_hw=[hw, hw],
                runtime_version="1.20.0",
                max_opset=22,
            ),
        )


def _model_status(client: TestClient, agent: str, version: str, state: str, reason=None) -> None:  # type: ignore[no-untyped-def]
    app_state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with app_state.sessions.begin() as session:
        crud.record_model_status(
            session=session,
            status=ModelStatus(
                fleet="plant-3",
                agent=agent,
                model_name="user-model",
                model_version=version,
                state=state,
                reason=reason,
                at=datetime.now(UTC),
            ),
        )


def test_upload_refuses_a_model_no_agent_can_run_with_the_reason(
    client: TestClient, tmp_path: Path
) -> None:
    raw = _upload(client, _user_model(tmp_path / "raw.onnx", 16, labels_meta=LABELS))
    assert raw.status_code == 422, raw.text
    assert raw.json()["reason"] == "incompatible_input"
    assert "'frames' -> 'scores'" in raw.json()["detail"]
    assert "edgeloop models import" in raw.json()["detail"]

    wrong_labels = make_tiny_student(tmp_path / "labels.onnx", size=16, classes=4)
    model = onnx.load(str(wrong_labels))
    for prop in model.metadata_props:
        if prop.key == "edgeloop.labels":
            prop.value = json.dumps(["x", "y", "z"])
    onnx.save(model, str(wrong_labels))
    refused = _upload(client, wrong_labels)
    assert refused.status_code == 422, refused.text
    assert refused.json()["reason"] == "labels"
    assert "4 scores per input for 3 labels" in refused.json()["detail"]

    broken = make_tiny_student(tmp_path / "broken.onnx", size=16)
    model = onnx.load(str(broken))
    model.graph.node[1].op_type = "NoSuchOp"
    onnx.save(model, str(broken))
    unloadable = _upload(client, broken)
    assert unloadable.status_code == 422, unloadable.text
    assert unloadable.json()["reason"] == "load_failed"

    other_task = make_tiny_student(tmp_path / "segmenter.onnx", size=16)
    model = onnx.load(str(other_task))
    model.metadata_props.add(key="edgeloop.task", value="segmentation")
    onnx.save(model, str(other_task))
    unknown = _upload(client, other_task)
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["reason"] == "unsupported_task"
    assert "unknown task 'segmentation'" in unknown.json()["detail"]
    assert client.get("/v1/models", headers=ADMIN).json() == []


def test_the_manifest_names_the_task_the_model_declares(tmp_path: Path) -> None:
    from cloud_service.registry import build_manifest

    plain = make_tiny_student(tmp_path / "plain.onnx", size=16)
    assert build_manifest(plain.read_bytes()).task is None  # a model from before tasks
    model = onnx.load(str(plain))
    model.metadata_props.add(key="edgeloop.task", value="classification")
    onnx.save(model, str(plain))
    assert build_manifest(plain.read_bytes()).task == "classification"


def test_upload_and_promotion_refuse_what_the_fleets_agents_would_refuse(
    client: TestClient, tmp_path: Path
) -> None:
    _heartbeat(client, "cam-1", "plant-3", 32, "user-model")
    _heartbeat(client, "cam-2", "plant-3", 32, "user-model")
    too_big = _imported(tmp_path, 24, version="2")
    refused = _upload(client, too_big, fleet="plant-3")
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["reason"] == "incompatible_input"
    assert "2 agent(s) would refuse user-model 2" in body["detail"]
    assert "agent cam-1 (fleet plant-3)" in body["detail"]
    assert "[batch, 32, 32, 3]" in body["detail"] and "24" in body["detail"]
    # Without a fleet, the agents serving a model of that name are the ones asked.
    assert _upload(client, too_big).status_code == 422

    fits = _upload(client, _imported(tmp_path, 32, version="3"), fleet="plant-3")
    assert fits.status_code == 201, fits.text
    assert fits.json()["manifest"]["source"]["input"]["layout"] == "NCHW"
    assert fits.json()["manifest"]["input"]["shape"] == ["batch", 32, 32, 3]

    # Another name, no fleet given: nobody serves it yet, so it registers; announcing
    # it to plant-3 is refused (409) with the agents' reason.
    other = _upload(client, _imported(tmp_path, 24, name="other-model", version="1"))
    assert other.status_code == 201, other.text
    promoted = client.post(
        "/v1/models/other-model/1/promote", json={"fleet": "plant-3"}, headers=ADMIN
    )
    assert promoted.status_code == 409, promoted.text
    assert promoted.json()["reason"] == "incompatible_input"
    pinned = client.post(
        "/v1/models/other-model/1/pin",
        json={"fleet": "plant-3", "agents": ["cam-2"]},
        headers=ADMIN,
    )
    assert pinned.status_code == 409 and "cam-2" in pinned.json()["detail"]


def test_registered_name_and_version_are_the_ones_the_agent_tags_samples_with(
    client: TestClient, tmp_path: Path
) -> None:
    path = make_tiny_student(tmp_path / "m.onnx", size=16, version="test-1")
    created = _upload(client, path, name="line-4", version="2026.12.02")
    assert created.status_code == 201, created.text
    artifact = client.get("/v1/models/line-4/2026.12.02/artifact", headers=ADMIN)
    stored = tmp_path / "stored.onnx"
    stored.write_bytes(artifact.content)
    import hashlib

    assert hashlib.sha256(artifact.content).hexdigest() == created.json()["sha256"]
    engine = OrtEngine(stored, EngineOptions(providers=("CPUExecutionProvider",), warmup_runs=1))
    assert (engine.name, engine.version) == ("line-4", "2026.12.02")


def test_models_page_shows_per_agent_install_state_never_serving_when_refused(
    client: TestClient, tmp_path: Path
) -> None:
    for agent in ("cam-1", "cam-2", "cam-3"):
        _heartbeat(client, agent, "plant-3", 32, "user-model")
    assert _upload(client, _imported(tmp_path, 32, version="5")).status_code == 201
    promoted = client.post(
        "/v1/models/user-model/5/promote", json={"fleet": "plant-3"}, headers=ADMIN
    )
    assert promoted.status_code == 200, promoted.text
    detail = client.get("/v1/models/user-model/5", headers=ADMIN).json()
    assert detail["state"] == "serving"
    assert detail["agents"] == {"installed": 0, "refused": 0, "pending": 3}
    assert {i["state"] for i in detail["installs"]} == {"pending"}

    _model_status(client, "cam-1", "5", "rejected", "incompatible_input: model takes ...")
    _model_status(client, "cam-2", "5", "rejected", "golden_mismatch: golden[0] differs")
    detail = client.get("/v1/models/user-model/5", headers=ADMIN).json()
    assert detail["state"] == "refused"
    listed = client.get("/v1/models", headers=ADMIN).json()
    assert [(v["state"], v["agents"]["refused"]) for v in listed] == [("refused", 2)]
    states = {i["agent"]: (i["state"], i["reason"]) for i in detail["installs"]}
    assert states == {
        "cam-1": ("refused", "incompatible_input: model takes ..."),
        "cam-2": ("refused", "golden_mismatch: golden[0] differs"),
        "cam-3": ("pending", None),
    }

    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.create_user(session=session, username="ada", password=PASSWORD, role="admin")
    page = client.get("/ui/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token
    client.post(
        "/ui/login",
        data={"username": "ada", "password": PASSWORD, "csrf_token": token.group(1)},
    )
    html = client.get("/ui/models").text
    row = html[html.index('id="version-user-model-5"') :].split("</tr>")[0]
    assert ">refused<" in row and ">serving<" not in row
    assert 'cam-1</b> (plant-3): refused: <span class="reason">incompatible_input' in row
    assert "cam-3</b> (plant-3): pending" in row
    assert "imported from source-32.onnx (float32 NCHW, scale 0.003922" in row

    _model_status(client, "cam-3", "5", "active")
    html = client.get("/ui/models").text
    row = html[html.index('id="version-user-model-5"') :].split("</tr>")[0]
    assert ">partly refused<" in row and "1 installed · 2 refused" in row


def test_an_agents_own_heartbeat_is_what_the_registry_judges_by(
    client: TestClient, tmp_path: Path
) -> None:
    student = make_tiny_student(tmp_path / "student.onnx", size=32, name="user-model")
    settings = AgentSettings(
        data_dir=tmp_path / "agent",
        model_path=student,
        fleet="plant-3",
        agent_id="cam-9",
        intra_op_threads=1,
        warmup_runs=1,
        heartbeat_s=3600.0,
    )
    publisher = MemoryPublisher()
    with Agent(settings, publisher=publisher, start_sources=False) as agent:
        agent._publish_status()  # the heartbeat, now rather than after heartbeat_s
        payload = [m[1] for m in publisher.messages if m[0] == agent.topic_status][-1]
    status = decode_message(payload, AgentStatus)
    assert status.model_name == "user-model" and status.input_hw == [32, 32]
    assert status.runtime_version and status.max_opset and status.max_opset >= 17
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        crud.record_agent_status(session=session, status=status)
    refused = _upload(client, _imported(tmp_path, 24, version="9"), fleet="plant-3")
    assert refused.status_code == 422 and "agent cam-9 (fleet plant-3)" in refused.json()["detail"]
    assert _upload(client, _imported(tmp_path, 32, version="9")).status_code == 201


def test_upload_refuses_a_model_whose_announcement_agents_would_not_take(
    client: TestClient, tmp_path: Path
) -> None:
    refused = _upload(client, _imported(tmp_path, 512, version="big"))
    assert refused.status_code == 422, refused.text
    assert refused.json()["reason"] == "too_large"
    assert "agents accept at most 1048576" in refused.json()["detail"]
