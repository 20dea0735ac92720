"""Requests the server's protocol answers itself (shared.http_server.RawRoute), and the
ones it leaves to the ASGI app: which goes where, order, keep-alive, lost clients."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources import http as http_source
from edge_agent.sources.http import ApiServer, create_app
from edge_agent.testing import MemoryPublisher
from shared.http_limits import Receive, Scope, Send
from shared.http_server import RawResponder, ServerLimits

Held = tuple[bytes, RawResponder, asyncio.AbstractEventLoop]


class HeldRoute:
    """``POST /echo`` with an octet-stream body; the test answers each request itself."""

    path = b"/echo"
    max_bytes = 64

    def __init__(self) -> None:
        self.requests: queue.Queue[Held] = queue.Queue()

    def accepts(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        return (b"content-type", b"application/octet-stream") in headers

    def handle(self, body: bytes, respond: RawResponder) -> None:
        self.requests.put((body, respond, asyncio.get_running_loop()))

    def next(self) -> Held:
        return self.requests.get(timeout=60)


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers every request with its path and body, so a test sees the app answered."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    data = json.dumps({"app": scope["path"], "body": body.decode()}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def answer(
    held: Held, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> Future[None]:
    """Answer on the server's loop; the future holds what ``respond`` raised, if anything."""
    _, respond, loop = held
    done: Future[None] = Future()

    def respond_there() -> None:
        try:
            respond(status, body, headers)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)

    loop.call_soon_threadsafe(respond_there)
    return done


class Reader:
    """HTTP/1.1 responses off one socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines)
        length = int(headers[b"content-length"])
        while len(self.buffer) < length:
            self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed after {self.buffer!r}"
        self.buffer += chunk


def post(
    body: bytes, *, target: bytes = b"/echo", extra: bytes = b"", version: bytes = b"1.1"
) -> bytes:
    return (
        b"POST " + target + b" HTTP/" + version + b"\r\nHost: x\r\n"
        b"Content-Type: application/octet-stream\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


@pytest.fixture
def agent(make_settings: Callable[..., AgentSettings], engine: object) -> Iterator[Agent]:
    publisher = MemoryPublisher()
    with Agent(make_settings(), engine=engine, publisher=publisher) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture
def route() -> HeldRoute:
    return HeldRoute()


@pytest.fixture
def connect(route: HeldRoute) -> Iterator[Callable[[], tuple[socket.socket, Reader]]]:
    sockets: list[socket.socket] = []
    with ApiServer(asgi_app, raw_route=route) as server:

        def open_one() -> tuple[socket.socket, Reader]:
            sock = socket.create_connection((server.host, server.port), timeout=60)
            sockets.append(sock)
            return sock, Reader(sock)

        yield open_one
        for sock in sockets:
            sock.close()


def test_a_fitting_request_is_the_routes_and_the_connection_stays_open(
    route: HeldRoute, connect: Callable[[], tuple[socket.socket, Reader]]
) -> None:
    sock, reader = connect()
    for n in range(2):  # keep-alive: the second request on the same connection
        sock.sendall(post(b"frame-%d" % n))
        held = route.next()
        assert held[0] == b"frame-%d" % n
        answer(held, 429, b'{"n": %d}' % n, [(b"retry-after", b"2")])
        # A second answer to one request writes nothing (else the next read would be it).
        assert answer(held, 200, b'{"again": true}').result(60) is None
        status, headers, body = reader.response()
        assert (status, body) == (429, b'{"n": %d}' % n)
        assert headers[b"content-type"] == b"application/json"
        assert headers[b"retry-after"] == b"2"
        assert b"connection" not in headers
    assert route.requests.empty()


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(post(b"x", target=b"/echo?debug=1"), id="query string"),
        pytest.param(post(b"x", target=b"/echo/"), id="another path"),
        pytest.param(post(b"x", extra=b"Connection: close\r\n"), id="connection close"),
        pytest.param(post(b"x", version=b"1.0"), id="HTTP/1.0"),
        pytest.param(post(b"x" * 65), id="over the route's limit"),
        pytest.param(
            post(b"x").replace(b"application/octet-stream", b"text/plain"), id="content type"
        ),
        pytest.param(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            id="chunked",
        ),
        pytest.param(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", id="GET"),
    ],
)
def test_other_requests_are_the_apps(
    route: HeldRoute,
    connect: Callable[[], tuple[socket.socket, Reader]],
    request_bytes: bytes,
) -> None:
    sock, reader = connect()
    sock.sendall(request_bytes)
    status, _, body = reader.response()
    assert status == 200
    assert json.loads(body)["app"].startswith("/echo")
    assert route.requests.empty()


def test_pipelined_requests_are_answered_in_order(
    route: HeldRoute, connect: Callable[[], tuple[socket.socket, Reader]]
) -> None:
    sock, reader = connect()
    # Sent at once: the second and third wait for the first, the route's (the ASGI way).
    sock.sendall(post(b"first") + b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"third"))
    held = route.next()
    assert held[0] == b"first"
    answer(held, 200, b'{"route": "first"}')
    assert reader.response()[2] == b'{"route": "first"}'
    assert json.loads(reader.response()[2]) == {"app": "/second", "body": ""}
    assert json.loads(reader.response()[2]) == {"app": "/echo", "body": "third"}
    assert route.requests.empty()


def test_an_answer_for_a_client_gone_meanwhile_is_dropped_and_others_are_served(
    route: HeldRoute, connect: Callable[[], tuple[socket.socket, Reader]]
) -> None:
    gone, _ = connect()
    gone.sendall(post(b"gone"))
    held = route.next()
    gone.close()
    assert answer(held, 200, b"{}").result(60) is None  # dropped, no error
    assert answer(held, 200, b"{}").result(60) is None
    sock, reader = connect()
    sock.sendall(post(b"next"))
    held = route.next()
    assert held[0] == b"next"
    answer(held, 200, b'{"ok": true}')
    assert reader.response()[:1] == (200,)


def test_a_request_in_flight_at_shutdown_is_answered_then_its_connection_closed(
    route: HeldRoute, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ApiServer(asgi_app, raw_route=route).start()
    protocol = server.server.config.http_protocol_class
    asked = threading.Event()
    shutdown = protocol.shutdown  # type: ignore[attr-defined]

    def shutdown_and_tell(self: Any) -> None:
        shutdown(self)
        asked.set()

    monkeypatch.setattr(protocol, "shutdown", shutdown_and_tell)
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        reader = Reader(sock)
        sock.sendall(post(b"late"))
        held = route.next()
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        assert asked.wait(60)  # the server waits for the answer before it stops
        answer(held, 200, b'{"late": true}')
        status, headers, body = reader.response()
        assert (status, body, headers[b"connection"]) == (200, b'{"late": true}', b"close")
        assert sock.recv(1) == b""
        stopping.join(60)
    assert not stopping.is_alive()


class AnsweringRoute(HeldRoute):
    """Answers each request at once, inside ``handle`` (as a rate-limit refusal does)."""

    def handle(self, body: bytes, respond: RawResponder) -> None:
        respond(200, b'{"at once": true}', ())


def test_after_an_answer_given_at_once_a_slow_next_head_is_cut_off() -> None:
    limits = ServerLimits(header_timeout_s=0.5)
    with (
        ApiServer(asgi_app, raw_route=AnsweringRoute(), limits=limits) as server,
        socket.create_connection((server.host, server.port), timeout=60) as sock,
    ):
        reader = Reader(sock)
        sock.sendall(post(b"x"))
        assert reader.response()[2] == b'{"at once": true}'
        sock.sendall(b"POST /ec")  # the next request's head, never finished
        assert sock.recv(1024) == b""  # closed by the server


def test_frame_uploads_with_a_declared_length_skip_the_asgi_app(
    agent: Agent, make_image: Callable[..., bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatched: list[str] = []
    dispatch = http_source.AgentApi.dispatch

    async def counted(self: http_source.AgentApi, scope: Any, receive: Any, send: Any) -> None:
        dispatched.append(scope["path"])
        await dispatch(self, scope, receive, send)

    monkeypatch.setattr(http_source.AgentApi, "dispatch", counted)
    jpeg = make_image(64, 48)
    with (
        ApiServer(create_app(agent)) as server,
        socket.create_connection((server.host, server.port), timeout=60) as sock,
    ):
        reader = Reader(sock)
        head = b"POST /v1/frames HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(jpeg) + jpeg)
        status, headers, body = reader.response()
        assert status == 200, body
        assert headers[b"content-type"] == b"application/json"
        raw_answer = json.loads(body)
        assert dispatched == []
        # The same upload chunked goes through the app, with an answer of the same shape.
        chunked = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(jpeg) + jpeg + b"\r\n0\r\n\r\n"
        sock.sendall(head + chunked)
        status, _, body = reader.response()
        assert status == 200, body
        assert dispatched == ["/v1/frames"]
        assert json.loads(body).keys() == raw_answer.keys()
        # A refusal on the raw route names what is accepted, and is counted.
        bad = b"\xff\xd8 not a jpeg"
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(bad) + bad)
        status, _, body = reader.response()
        refusal = json.loads(body)
        assert status == 400, body
        assert "JPEG or PNG" in refusal["accepted"]
        counted_refusals = agent.telemetry.bad_input.labels("http", refusal["reason"])._value.get()
        assert counted_refusals == 1
        assert dispatched == ["/v1/frames"]
