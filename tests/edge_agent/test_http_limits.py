"""HTTP limits of the agent's local API: slow heads cut off, bodies held to their route's
limit before they are read, control characters refused."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import AgentApi, ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from tests.asgi import call_asgi

MAX_IMAGE = 64 << 10


@pytest.fixture
def agent(make_settings: Callable[..., AgentSettings], engine: object) -> Iterator[Agent]:
    settings = make_settings(max_image_bytes=MAX_IMAGE)
    with Agent(settings, engine=engine, publisher=MemoryPublisher()) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def server(agent: Agent) -> Iterator[ApiServer]:
    with ApiServer(create_app(agent)) as running:
        yield running


def test_a_slow_request_head_is_cut_off(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    settings = make_settings(http_header_timeout_s=0.5)
    with (
        Agent(settings, engine=engine, publisher=MemoryPublisher()) as agent,  # type: ignore[arg-type]
        ApiServer(create_app(agent)) as server,
    ):
        _slow_heads_are_closed(server)


def _slow_heads_are_closed(server: ApiServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/frames HTTP/1.1\r\nHost: x\r\nContent-Type: image/")
        assert sock.recv(1024) == b""  # closed by the agent (the timeout is a safety net)
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'"ok"' not in answer:
            answer += sock.recv(4096)
        sock.sendall(b"GET /heal")  # the next request's head, never finished
        assert sock.recv(1024) == b""


async def _call(
    app: AgentApi, method: str, path: str, headers: dict[str, str], chunks: list[bytes]
) -> tuple[int, bytes, int]:
    """Run one request through ``app``; (status, body, body chunks it pulled)."""
    status, _headers, body, pulled = await call_asgi(app, method, path, headers, chunks)
    return status, body, pulled


def test_a_huge_chunked_multipart_frame_is_cut_off_early(agent: Agent) -> None:
    app = create_app(agent)
    head = (
        b'--b\r\nContent-Disposition: form-data; name="frame"; filename="f.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n"
    )
    chunks = [head] + [b"\xff" * 16384] * 640  # 10 MiB, chunked (no declared length)
    headers = {"Content-Type": "multipart/form-data; boundary=b", "Transfer-Encoding": "chunked"}
    status, body, pulled = asyncio.run(_call(app, "POST", "/v1/frames", headers, chunks))
    assert status == 413, body
    limit = MAX_IMAGE + 65536  # the image limit plus multipart framing
    assert pulled * 16384 <= limit + 2 * 16384, f"read {pulled} chunks past the limit"
    assert b"too_large" in body and b"multipart/form-data" in body


def test_bodies_of_other_routes_are_held_to_the_small_limit(agent: Agent) -> None:
    app = create_app(agent)
    headers = {"Content-Type": "application/json", "Content-Length": str(10 << 20)}
    status, body, pulled = asyncio.run(_call(app, "POST", "/v1/model/rollback", headers, [b"{}"]))
    assert (status, pulled) == (413, 0), body
    assert b'"limit_bytes": 65536' in body


@pytest.mark.parametrize("path", ["/v1/samples/%00", "/v1/samples/a%0Ab", "/v1/status?x=%00"])
def test_control_characters_are_a_400(server: ApiServer, path: str) -> None:
    response = httpx.get(server.url + path, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["reason"] == "control_character"


def test_a_declared_oversize_frame_is_refused_and_counted(server: ApiServer, agent: Agent) -> None:
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/frames HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: 209715200\r\n\r\n"
        )
        answer = b""
        while b"too_large" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer
    counted = agent.telemetry.bad_input.labels("http", "too_large")._value.get()
    assert counted >= 1


def _answer_to(server: ApiServer, head: bytes) -> bytes:
    """What the server sends back to ``head`` before it closes the connection."""
    answer = b""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(head)
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


@pytest.mark.parametrize("finished", [True, False])
def test_a_request_head_over_the_limit_is_a_431_and_the_connection_closes(
    server: ApiServer, finished: bool
) -> None:
    limit = AgentSettings.model_fields["http_max_head_bytes"].default
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * (limit + 100)
    answer = _answer_to(server, head + (b"\r\n\r\n" if finished else b"\r\n"))
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert f"request head over {limit} bytes".encode() in answer


def test_heads_within_the_limit_are_served_one_after_another_on_a_connection(
    server: ApiServer,
) -> None:
    padding = b"X-Padding: " + b"a" * 8000 + b"\r\n"
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n"
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        for _ in range(3):  # each head counted afresh, not the connection's total
            sock.sendall(request)
            answer = b""
            while b'"ok"' not in answer:
                chunk = sock.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
