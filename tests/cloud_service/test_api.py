"""The REST API on both databases: enrollment, samples, labels, stats, KServe V2, bad input."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.ingest import IngestSample, sample_row
from cloud_service.settings import CloudSettings
from cloud_service.verifier import decode_image
from shared.manifest import FleetSigningKey
from tests.cloud_service.conftest import SIZE, image_bytes, make_header

with warnings.catch_warnings():
    # Starlette 1.x warns that its TestClient wants the httpx2 package; the httpx
    # we have works, and pytest turns warnings into errors at import time.
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.sql

ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def client(make_settings: Callable[..., CloudSettings], database_url: str) -> Iterator[TestClient]:
    app = create_app(make_settings(database_url=database_url, admin_token="test-admin-token"))
    with TestClient(app) as test_client:
        yield test_client


def _store_sample(client: TestClient, **kwargs: object) -> str:
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    image = image_bytes()
    header = make_header(image, **kwargs)  # type: ignore[arg-type]
    sample = IngestSample(header=header, image=image, pixels=decode_image(image, None))
    state.blobs.put(sample.image_key, image)
    row = sample_row(sample, datetime.now(UTC), sample.image_key)
    with state.sessions.begin() as session:
        crud.insert_samples(session=session, rows=[row])
    return header.sample_id


def test_enrollment_flow(client: TestClient) -> None:
    made = client.post(
        "/v1/enrollment-tokens",
        json={"fleet": "fleet-a", "agent_id": None, "ttl_s": 600},
        headers=ADMIN,
    )
    assert made.status_code == 201, made.text
    token = made.json()["token"]
    enrolled = client.post("/v1/enroll", json={"token": token, "agent_id": "cam-7"})
    assert enrolled.status_code == 200, enrolled.text
    body = enrolled.json()
    assert body["agent_id"] == "cam-7" and body["fleet"] == "fleet-a"
    assert body["mqtt_url"].startswith("mqtt://") and body["mqtt_password"] is None
    key = FleetSigningKey.load(client.app.state.edgeloop.settings.resolved_signing_key_file)  # type: ignore[attr-defined]
    assert body["fleet_public_key"] == key.public_key_b64 and body["key_id"] == key.key_id
    assert body["api_token"].startswith("ela_")
    # The same agent again (its answer was lost): re-keyed, the first API token retired.
    again = client.post("/v1/enroll", json={"token": token, "agent_id": "cam-7"})
    assert again.status_code == 200, again.text
    assert again.json()["api_token"] != body["api_token"]
    old_auth = {"Authorization": f"Bearer {body['api_token']}"}
    new_auth = {"Authorization": f"Bearer {again.json()['api_token']}"}
    artifact = "/v1/models/none/none/artifact"
    assert client.get(artifact, headers=old_auth).status_code == 401
    assert client.get(artifact, headers=new_auth).status_code == 404
    other = client.post("/v1/enroll", json={"token": token, "agent_id": "cam-8"})
    assert other.status_code == 409 and "already used" in other.json()["detail"]
    unknown = client.post("/v1/enroll", json={"token": "elt_nope-nope", "agent_id": None})
    assert unknown.status_code == 401 and "not known" in unknown.json()["detail"]
    agents = client.get("/v1/agents", headers=ADMIN).json()
    assert [a["agent_id"] for a in agents["items"]] == ["cam-7"]
    assert client.get("/v1/agents/cam-7", headers=ADMIN).json()["state"] == "enrolled"


def test_expired_and_bound_tokens(client: TestClient) -> None:
    state = client.app.state.edgeloop  # type: ignore[attr-defined]
    with state.sessions.begin() as session:
        old, _ = crud.create_enrollment_token(
            session=session,
            fleet="f",
            agent_id=None,
            ttl_s=60,
            now=datetime(2020, 1, 1, tzinfo=UTC),
        )
        bound, _ = crud.create_enrollment_token(
            session=session, fleet="f", agent_id="cam-1", ttl_s=600
        )
    expired = client.post("/v1/enroll", json={"token": old})
    assert expired.status_code == 401 and "expired" in expired.json()["detail"]
    other = client.post("/v1/enroll", json={"token": bound, "agent_id": "cam-2"})
    assert other.status_code == 409 and "cam-1" in other.json()["detail"]
    assert client.post("/v1/enroll", json={"token": bound}).json()["agent_id"] == "cam-1"


def test_admin_endpoints_need_the_admin_token(client: TestClient) -> None:
    for path in ("/v1/agents", "/v1/samples", "/v1/verdicts", "/v1/stats", "/v1/dead-letters"):
        missing = client.get(path)
        assert missing.status_code == 401 and "Bearer" in missing.json()["detail"]
        wrong = client.get(path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    made = client.post("/v1/enrollment-tokens", json={"fleet": "f"})
    assert made.status_code == 401


def test_samples_labels_and_stats(client: TestClient) -> None:
    first = _store_sample(client, agent="cam-1")
    _store_sample(client, agent="cam-2")
    page = client.get("/v1/samples", params={"agent_id": "cam-1"}, headers=ADMIN).json()
    assert page["total"] == 1 and page["items"][0]["sample_id"] == first
    everything = client.get("/v1/samples", params={"limit": 1}, headers=ADMIN).json()
    assert everything["total"] == 2 and len(everything["items"]) == 1
    detail = client.get(f"/v1/samples/{first}", headers=ADMIN).json()
    assert detail["status"] == "pending" and detail["verdict"] is None
    image = client.get(f"/v1/samples/{first}/image", headers=ADMIN)
    assert image.status_code == 200 and image.headers["content-type"] == "image/jpeg"
    assert image.content[:2] == b"\xff\xd8"
    label = client.post(
        f"/v1/samples/{first}/labels", json={"label": 3, "labeled_by": "ann"}, headers=ADMIN
    )
    assert label.status_code == 201, label.text
    assert client.get(f"/v1/samples/{first}", headers=ADMIN).json()["status"] == "reviewed"
    stats = client.get("/v1/stats", headers=ADMIN).json()
    assert stats["samples_total"] == 2 and stats["labels"] == 1


@pytest.mark.parametrize(
    ("method", "path", "body", "code", "words"),
    [
        ("get", "/v1/samples/not-a-uuid", None, 422, "sample_id"),
        ("get", "/v1/samples/01a228d1-b55d-763c-92af-e79c93738210", None, 404, "not stored"),
        ("get", "/v1/samples?limit=0", None, 422, "greater than or equal to 1"),
        ("get", "/v1/samples?limit=100000", None, 422, "less than or equal to 500"),
        ("get", "/v1/samples?status=lost", None, 422, "pending"),
        ("get", "/v1/samples?since=yesterday", None, 422, "datetime"),
        ("get", "/v1/samples?fleet=Bad/Fleet", None, 422, "a-z"),
        ("get", "/v1/agents/nobody", None, 404, "not known"),
        ("post", "/v1/enrollment-tokens", {"fleet": "UPPER"}, 422, "a-z"),
        ("post", "/v1/enrollment-tokens", {"fleet": "f", "ttl_s": 1}, 422, "60"),
        ("post", "/v1/enrollment-tokens", {"fleet": "f", "extra": 1}, 422, "extra"),
        ("post", "/v1/enroll", {"token": 5}, 422, "string"),
        ("post", "/v1/enroll", "not json", 422, "JSON"),
    ],
)
def test_bad_input_is_a_4xx_that_says_what_is_accepted(
    client: TestClient, method: str, path: str, body: object, code: int, words: str
) -> None:
    if isinstance(body, str):
        response = client.request(
            method, path, content=body, headers={**ADMIN, "content-type": "application/json"}
        )
    else:
        response = client.request(method, path, json=body, headers=ADMIN)
    assert response.status_code == code, response.text
    assert words.lower() in response.text.lower()


def test_label_for_a_class_that_does_not_exist(client: TestClient) -> None:
    sample_id = _store_sample(client)
    response = client.post(
        f"/v1/samples/{sample_id}/labels", json={"label": 99, "labeled_by": "ann"}, headers=ADMIN
    )
    assert response.status_code == 422 and "0..9" in response.json()["detail"]


def test_health_and_metrics(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "edgeloop_http_requests_total" in metrics.text


def test_kserve_v2_endpoints(client: TestClient) -> None:
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").status_code == 200
    meta = client.get("/v2/models/teacher").json()
    assert meta["inputs"][0] == {
        "name": "frames",
        "datatype": "UINT8",
        "shape": [-1, SIZE, SIZE, 3],
    }
    frames = np.random.default_rng(0).integers(0, 255, (2, SIZE, SIZE, 3), dtype=np.uint8)
    request: dict[str, Any] = {
        "id": "r1",
        "inputs": [
            {
                "name": "frames",
                "shape": [2, SIZE, SIZE, 3],
                "datatype": "UINT8",
                "data": frames.reshape(-1).tolist(),
            }
        ],
    }
    response = client.post("/v2/models/teacher/infer", json=request)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    assert out["name"] == "scores" and out["shape"] == [2, 10] and out["datatype"] == "FP32"
    scores = np.asarray(out["data"]).reshape(2, 10)
    assert np.allclose(scores.sum(axis=1), 1.0, atol=1e-4)
    teacher = client.app.state.edgeloop.teacher()  # type: ignore[attr-defined]
    assert np.allclose(scores, teacher.predict(frames), atol=1e-6)
    bad = client.post(
        "/v2/models/teacher/infer",
        json={
            "inputs": [
                {"name": "frames", "shape": [1, 3, 3, 3], "datatype": "UINT8", "data": [0] * 27}
            ]
        },
    )
    assert bad.status_code == 400 and f"[N, {SIZE}, {SIZE}, 3]" in bad.json()["error"]
    wrong_type = dict(request, inputs=[dict(request["inputs"][0], datatype="FP32")])
    assert client.post("/v2/models/teacher/infer", json=wrong_type).status_code == 400
    assert client.get("/v2/models/student").status_code == 404


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(
        [
            "/v1/enroll",
            "/v1/enrollment-tokens",
            "/v2/models/teacher/infer",
            "/v1/samples/01a228d1-b55d-763c-92af-e79c93738210/labels",
        ]
    ),
    body=_json | st.fixed_dictionaries({"token": _json, "fleet": _json, "inputs": _json}),
)
def test_random_json_bodies_never_get_a_5xx(client: TestClient, path: str, body: object) -> None:
    response = client.post(path, json=body, headers=ADMIN)
    assert response.status_code < 500, (path, body, response.text)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("content_type", "body", "words"),
    [
        ("application/json", b"", "registration is not valid"),
        ("application/json", b"{not json", "registration is not valid"),
        ("application/json", b'{"path": 5}', "path"),
        ("application/json", b'{"path": "/x", "surplus": 1}', "surplus"),
        ("text/plain", b"hello", "registration is not valid"),
        (None, b"", "registration is not valid"),
    ],
)
def test_model_registration_with_a_bad_body_is_a_422(
    client: TestClient, content_type: str | None, body: bytes, words: str
) -> None:
    headers = {**ADMIN, **({"content-type": content_type} if content_type else {})}
    response = client.post("/v1/models", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert words in response.json()["detail"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("metrics", ["{not json", "[1, 2]", '{"top1": "high"}', '{"top1": null}'])
def test_model_upload_with_bad_metrics_is_a_422(client: TestClient, metrics: str) -> None:
    response = client.post(
        "/v1/models",
        files={"file": ("m.onnx", b"not onnx", "application/octet-stream")},
        data={"metrics": metrics},
        headers=ADMIN,
    )
    assert response.status_code == 422, response.text
    assert "'metrics' must be a JSON object of numbers" in response.json()["detail"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_writes_are_committed_before_the_answer_is_sent(
    make_settings: Callable[..., CloudSettings], database_url: str
) -> None:
    from sqlalchemy import event

    events: list[str] = []
    app = create_app(make_settings(database_url=database_url, admin_token="test-admin-token"))
    event.listen(app.state.edgeloop.sessions, "after_commit", lambda _s: events.append("commit"))

    async def spy(scope, receive, send):  # type: ignore[no-untyped-def]
        async def sending(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.start":
                events.append(f"answer {message['status']}")
            await send(message)

        await app(scope, receive, sending)

    with TestClient(spy) as client:
        made = client.post("/v1/enrollment-tokens", json={"fleet": "fleet-a"}, headers=ADMIN)
    assert made.status_code == 201
    # A 201 is sent only once the token is durable: a crash after it loses nothing.
    assert events == ["commit", "answer 201"], events


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/rollouts/2147483648"),
        ("post", "/v1/rollouts/173085393773342264131584/promote"),
        ("get", "/v1/jobs/9223372036854775808"),
        ("get", "/v1/jobs/1/logs?after=2147483648"),
        ("get", "/v1/schedules/2147483648"),
        ("delete", "/v1/schedules/2147483648"),
    ],
)
def test_row_ids_beyond_the_column_are_a_422(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path, headers=ADMIN)
    assert response.status_code == 422, response.text


@pytest.mark.parametrize(
    "path", ["/v1/rollouts/2147483647", "/v1/jobs/2147483647", "/v1/schedules/2147483647"]
)
def test_the_largest_row_id_is_just_not_found(client: TestClient, path: str) -> None:
    response = client.get(path, headers=ADMIN)
    assert response.status_code == 404, response.text
