"""The local HTTP API: answers, bad inputs (4xx naming what is accepted), health, metrics."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import httpx
import numpy as np
import pytest
from PIL import Image

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from shared.messages import Verdict, encode_message

ACCEPTED_HINT = "JPEG or PNG"


@pytest.fixture
def publisher() -> MemoryPublisher:
    return MemoryPublisher()


@pytest.fixture
def agent(
    make_settings: Callable[..., AgentSettings], engine: object, publisher: MemoryPublisher
) -> Iterator[Agent]:
    settings = make_settings(route_max_prob_below=1.01, max_pixels=1_000_000)
    with Agent(settings, engine=engine, publisher=publisher) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def client(agent: Agent) -> Iterator[httpx.Client]:
    with ApiServer(create_app(agent)) as server, httpx.Client(base_url=server.url) as test_client:
        yield test_client


def test_jpeg_frame_is_answered_and_forwarded(
    client: httpx.Client,
    make_image: Callable[..., bytes],
    publisher: MemoryPublisher,
    until: Callable[..., bool],
) -> None:
    response = client.post(
        "/v1/frames", content=make_image(64, 48), headers={"Content-Type": "image/jpeg"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["label"].startswith("class-")
    assert len(body["scores"]) == 4
    assert 0 < body["confidence"] <= 1
    assert body["forwarded"] is True
    assert body["route_reason"] == "low_confidence"
    assert body["latency_ms"] > 0
    assert until(lambda: len(publisher.sent()) == 1)
    sample = client.get(f"/v1/samples/{body['sample_id']}").json()
    assert sample["result"]["label"] == body["label"]


def test_png_and_multipart(client: httpx.Client, make_image: Callable[..., bytes]) -> None:
    png = make_image(40, 40, fmt="PNG")
    assert (
        client.post("/v1/frames", content=png, headers={"Content-Type": "image/png"}).status_code
        == 200
    )
    response = client.post("/v1/frames", files={"file": ("frame.png", png, "image/png")})
    assert response.status_code == 200, response.text


def test_grayscale_and_rgba_are_converted(client: httpx.Client) -> None:
    for mode in ("L", "RGBA"):
        buffer = io.BytesIO()
        Image.new(mode, (20, 30)).save(buffer, format="PNG")
        response = client.post(
            "/v1/frames", content=buffer.getvalue(), headers={"Content-Type": "image/png"}
        )
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("content", "content_type", "status", "reason"),
    [
        (b"hello, not an image", "image/jpeg", 400, "not_image"),
        (b"", "image/jpeg", 400, "empty"),
        (b"{}", "application/json", 415, "content_type"),
        (b"x", "", 415, "content_type"),
        (b"%PDF-1.4", "text/plain", 415, "content_type"),
    ],
)
def test_bad_inputs(
    client: httpx.Client, content: bytes, content_type: str, status: int, reason: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/v1/frames", content=content, headers=headers)
    assert response.status_code == status
    body = response.json()
    assert body["reason"] == reason
    assert ACCEPTED_HINT in body["detail"] or ACCEPTED_HINT in body["accepted"]
    assert "image/jpeg" in body["accepted"]


def test_truncated_jpeg(client: httpx.Client, make_image: Callable[..., bytes]) -> None:
    jpeg = make_image(64, 64)
    response = client.post(
        "/v1/frames", content=jpeg[: len(jpeg) // 2], headers={"Content-Type": "image/jpeg"}
    )
    assert response.status_code == 400
    assert response.json()["reason"] == "truncated"
    assert ACCEPTED_HINT in response.json()["detail"]


def test_truncated_png(client: httpx.Client, make_image: Callable[..., bytes]) -> None:
    png = make_image(64, 64, fmt="PNG")
    response = client.post(
        "/v1/frames", content=png[: len(png) // 2], headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 400
    assert ACCEPTED_HINT in response.json()["detail"]


def test_over_the_pixel_limit_is_refused_before_decoding(client: httpx.Client) -> None:
    # A 2000x1000 black JPEG: tiny on the wire, 2 MP in pixels (the limit here is 1 MP).
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((1000, 2000, 3), dtype=np.uint8)).save(buffer, format="JPEG")
    response = client.post(
        "/v1/frames", content=buffer.getvalue(), headers={"Content-Type": "image/jpeg"}
    )
    assert response.status_code == 413
    assert response.json()["reason"] == "too_many_pixels"
    assert "1000000 pixels" in response.json()["detail"]


def test_over_the_byte_limit(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    settings = make_settings(max_image_bytes=2048)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        big = make_image(256, 256, fmt="PNG")
        response = client.post("/v1/frames", content=big, headers={"Content-Type": "image/png"})
        assert response.status_code == 413
        assert response.json()["reason"] == "too_large"


def test_multipart_without_a_file(client: httpx.Client) -> None:
    response = client.post("/v1/frames", data={"note": "no file"}, files={})
    assert response.status_code in (400, 415)


def test_rate_limit(
    make_settings: Callable[..., AgentSettings], engine: object, make_image: Callable[..., bytes]
) -> None:
    settings = make_settings(http_max_fps=1.0)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        codes = [
            client.post(
                "/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"}
            ).status_code
            for _ in range(3)
        ]
    assert codes[0] == 200
    assert 429 in codes


def test_verdicts_are_matched_and_agreement_tracked(
    client: httpx.Client, agent: Agent, publisher: MemoryPublisher, make_image: Callable[..., bytes]
) -> None:
    ids = []
    for seed in range(2):
        body = client.post(
            "/v1/frames", content=make_image(seed=seed), headers={"Content-Type": "image/jpeg"}
        ).json()
        ids.append((body["sample_id"], body["predicted"]))
    for i, (sample_id, predicted) in enumerate(ids):
        verdict = Verdict(
            sample_id=sample_id,
            fleet="test-fleet",
            agent="agent-1",
            teacher_model="teacher",
            teacher_version="1",
            scores=[0.25, 0.25, 0.25, 0.25],
            label=predicted,
            confidence=0.25,
            agrees_with_edge=(i == 0),
            verified_at=datetime.now(UTC),
        )
        publisher.deliver(agent.topic_verdicts, encode_message(verdict))
    sample = client.get(f"/v1/samples/{ids[0][0]}").json()
    assert sample["verdict"]["agrees_with_edge"] is True
    assert agent.telemetry.agreement_rate == pytest.approx(0.5)
    assert client.get("/v1/samples/0190f5c2-7a1b-7c3d-8e4f-0123456789ab").status_code == 404


def test_malformed_messages_are_counted_not_fatal(agent: Agent, publisher: MemoryPublisher) -> None:
    publisher.deliver(agent.topic_receipts, b"not json")
    publisher.deliver(agent.topic_verdicts, b'{"schema": "edgeloop.verdict", "v": 99}')
    publisher.deliver(agent.topic_receipts, b'{"schema": "edgeloop.receipt", "v": 1}')
    text = "\n".join(
        f"{m.name} {s.labels} {s.value}"
        for m in agent.telemetry.registry.collect()
        for s in m.samples
        if m.name == "edgeloop_agent_malformed_messages"
    )
    assert "'receipt'" in text and "'verdict'" in text
    assert agent.ready


def test_health_ready_metrics_status(
    client: httpx.Client, make_image: Callable[..., bytes]
) -> None:
    client.post("/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"})
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    metrics = client.get("/metrics")
    assert "edgeloop_agent_frames_total" in metrics.text
    assert "edgeloop_agent_spool_depth" in metrics.text
    status = client.get("/v1/status").json()
    assert status["model"]["provider"] == "cpu"
    assert status["frames_total"] == 1
    assert status["memory_mb"] > 0


def test_heartbeat_is_published_retained(
    agent: Agent, publisher: MemoryPublisher, until: Callable[..., bool]
) -> None:
    assert until(lambda: any(m[0] == agent.topic_status for m in publisher.messages), timeout=5)
    _topic, payload, qos, retain = next(m for m in publisher.messages if m[0] == agent.topic_status)
    assert retain and qos == 1
    assert b'"state":"online"' in payload


def test_answers_are_strict_json_whatever_numbers_an_engine_gives() -> None:
    from edge_agent.sources.uploads import _json

    body = {"scores": [np.float32(0.25), float("nan")], "predicted": np.int64(3), "x": 1.5}
    text = _json(body)
    # Strict JSON (no bare NaN), numpy numbers as plain numbers.
    assert json.loads(text, parse_constant=lambda name: pytest.fail(name)) == {
        "scores": [0.25, None],
        "predicted": 3,
        "x": 1.5,
    }


def test_metrics_show_the_cpu_of_the_agents_threads(
    client: httpx.Client, make_image: Callable[..., bytes]
) -> None:
    client.post("/v1/frames", content=make_image(), headers={"Content-Type": "image/jpeg"})
    lines = client.get("/metrics").text.splitlines()
    threads = {
        line.split('thread="', 1)[1].split('"', 1)[0]
        for line in lines
        if line.startswith("edgeloop_thread_cpu_seconds_total{")
    }
    assert "other" in threads
    assert any(name.startswith("inference") for name in threads), threads


def test_a_jpeg_with_stray_bytes_is_answered_and_its_slow_decode_counted(
    client: httpx.Client, make_image: Callable[..., bytes]
) -> None:
    data = make_image(64, 48)
    scan = data.index(b"\xff\xda")
    stray = data[:scan] + b"\x12\x34\x56" + data[scan:]  # as some cameras write them

    def by_opencv() -> float:
        prefix = 'edgeloop_jpeg_fallback_decodes_total{outcome="opencv"} '
        lines = client.get("/metrics").text.splitlines()
        return next(float(line[len(prefix) :]) for line in lines if line.startswith(prefix))

    before = by_opencv()
    answered = client.post("/v1/frames", content=stray, headers={"Content-Type": "image/jpeg"})
    assert answered.status_code == 200, answered.text
    clean = client.post("/v1/frames", content=data, headers={"Content-Type": "image/jpeg"})
    # Decoded whole by OpenCV, then shrunk: the same picture, not the same pixels as the
    # reduced decode's.
    assert len(answered.json()["scores"]) == len(clean.json()["scores"])
    assert by_opencv() == before + 1
