"""HTTP limits both servers (the cloud API, the edge agent's local API) share.

- ``HttpLimitsMiddleware`` (pure ASGI, before any routing or parsing): refuses a
  path or query string with control characters (400), asks a ``Gate`` whether the
  request's credentials are good enough (up front, and again for the matched route
  when the application first reads the body, before a byte of it is read), and
  holds every body to its route's limit: 413 at once when ``Content-Length`` is over
  it, and for a chunked body 413 as soon as the streamed bytes pass it, without
  buffering more. A refusal of a large body (or one of unknown length) closes the
  connection, so its rest is never read.
- ``TrustedProxyMiddleware``: the client address (``scope["client"]``) and scheme come
  from ``X-Forwarded-For`` / ``X-Forwarded-Proto`` only when the peer is a trusted proxy.
- ``server_config``: the uvicorn configuration both servers run with: a request head
  must be complete within ``header_timeout_s`` of the connection (or of the previous
  response), idle keep-alive connections close, connections and head sizes are bounded.
- ``RawRoute``: one hot ``POST`` route a server's protocol answers itself, with no ASGI
  task, scope, middleware or message dicts (the edge agent's frame uploads). Only a
  request that needs none of what those give goes that way: HTTP/1.1, keep-alive, the
  route's exact path with no query, a ``Content-Length`` within the route's limit (so
  the body cannot pass it), no ``Transfer-Encoding`` or ``Expect``, nothing else in
  flight on the connection, and a head the route accepts; every other request,
  refusals of oversized bodies included, takes the ASGI path as before.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

__all__ = [
    "BodyRule",
    "Gate",
    "HttpLimitsMiddleware",
    "RawResponder",
    "RawRoute",
    "Refusal",
    "ServerLimits",
    "TrustedProxyMiddleware",
    "client_address",
    "parse_networks",
    "server_config",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
# A refused request whose body (left unread) is larger than this, or of unknown length,
# has its connection closed; a smaller rest is read and dropped by the server, so the
# client reads the refusal instead of a reset connection.
_DRAIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Refusal:
    """An answer sent instead of the application's: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False


Gate = Callable[[Scope], Awaitable[Refusal | None]]
"""Called before the body is read: a ``Refusal`` when the credentials do not pass, else None."""
Render = Callable[[Scope, int, str, str, dict[str, Any]], dict[str, Any]]
"""(scope, status, message, reason, extra) to the JSON body of a refusal."""


@dataclass(frozen=True)
class BodyRule:
    """The body limit of the requests whose method and path match."""

    pattern: str
    max_bytes: int
    accepts: str
    methods: frozenset[str] = field(default_factory=lambda: frozenset({"POST", "PUT", "PATCH"}))

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and re.fullmatch(self.pattern, path) is not None


def _default_render(
    scope: Scope, status: int, message: str, reason: str, extra: dict[str, Any]
) -> dict[str, Any]:
    return {"detail": message, "reason": reason, **extra}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, or None when absent or not a number."""
    declared = _header(scope, b"content-length")
    if declared is None or not declared.strip().isdigit():
        return None
    return int(declared)


def unread_is_large(scope: Scope, limit: int = 0) -> bool:
    """Whether the body left unread past ``limit`` is worth closing the connection for."""
    declared = declared_length(scope)
    if declared is None:
        return has_body(scope)
    return declared - limit > _DRAIN_BYTES


def has_body(scope: Scope) -> bool:
    """Whether the request declares a body (a non-zero length, or any transfer coding)."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        return declared.strip() not in (b"0", b"")
    return _header(scope, b"transfer-encoding") is not None


def control_character(scope: Scope) -> str | None:
    """Where the request's path or query string holds a control character, else None."""
    path: str = scope.get("path", "")
    if _CONTROL.search(path.encode("utf-8", "surrogateescape")):
        return "path"
    query: bytes = scope.get("query_string", b"")
    if query and (_CONTROL.search(query) or (b"%" in query and _decoded_control(query))):
        return "query string"
    return None


def _decoded_control(query: bytes) -> bool:
    return _CONTROL.search(unquote_to_bytes(query)) is not None


async def send_refusal(send: Send, refusal: Refusal) -> None:
    """Send ``refusal`` as the response (``close``: and close the connection after it)."""
    data = json.dumps(refusal.body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *refusal.headers,
    ]
    if refusal.close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class HttpLimitsMiddleware:
    """Control characters (400), the gate (before the body), and per-route body limits (413)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        default_max_bytes: int,
        default_accepts: str = "a JSON body",
        rules: Sequence[BodyRule] = (),
        gate: Gate | None = None,
        body_gate: Gate | None = None,
        render: Render = _default_render,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.default = BodyRule(r".*", default_max_bytes, default_accepts, methods=frozenset({"*"}))
        self.rules = tuple(rules)
        self.gate = gate
        self.body_gate = body_gate
        self.render = render
        self.on_refusal = on_refusal

    def rule_for(self, method: str, path: str) -> BodyRule:
        for rule in self.rules:
            if rule.matches(method, path):
                return rule
        return self.default

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        status: int,
        message: str,
        reason: str,
        extra: dict[str, Any] | None = None,
        *,
        close: bool = False,
    ) -> None:
        if self.on_refusal is not None:
            self.on_refusal(reason)
        body = self.render(scope, status, message, reason, extra or {})
        await send_refusal(send, Refusal(status, body, close=close))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        where = control_character(scope)
        if where is not None:
            await self._refuse(
                scope,
                send,
                400,
                f"the request's {where} holds a control character (such as NUL); "
                "percent-encoded printable text is accepted",
                "control_character",
            )
            return
        if self.gate is not None:
            refusal = await self.gate(scope)
            if refusal is not None:
                if self.on_refusal is not None:
                    self.on_refusal(str(refusal.body.get("reason", "unauthorized")))
                if unread_is_large(scope):
                    refusal = Refusal(refusal.status, refusal.body, refusal.headers, close=True)
                await send_refusal(send, refusal)
                return
        rule = self.rule_for(scope.get("method", ""), scope.get("path", ""))
        limit = rule.max_bytes
        extra = {"limit_bytes": limit, "accepted": rule.accepts}
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(
                scope,
                send,
                413,
                f"a body of {declared} bytes is over this route's limit of {limit} bytes",
                "too_large",
                extra,
                close=unread_is_large(scope, limit),
            )
            return
        await self._limited(scope, receive, send, limit, extra)

    async def _limited(
        self, scope: Scope, receive: Receive, send: Send, limit: int, extra: dict[str, Any]
    ) -> None:
        received = 0
        refused = False
        started = False
        gated = self.body_gate is None

        async def counted_receive() -> Message:
            nonlocal received, refused, gated
            if refused:
                return {"type": "http.disconnect"}
            if not gated and self.body_gate is not None:
                # The first read of the body: routing is done, so the gate knows the route.
                gated = True
                refusal = await self.body_gate(scope)
                if refusal is not None:
                    refused = True
                    if not started:
                        if self.on_refusal is not None:
                            self.on_refusal(str(refusal.body.get("reason", "unauthorized")))
                        close = unread_is_large(scope)
                        await send_refusal(
                            send, Refusal(refusal.status, refusal.body, refusal.headers, close)
                        )
                    return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await self._refuse(
                            scope,
                            send,
                            413,
                            f"the body passed this route's limit of {limit} bytes",
                            "too_large",
                            extra,
                            close=True,
                        )
                    # The application sees a client that went away and stops reading.
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the refusal went out instead
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # Refused mid-request: the application failed on the body it was not given.


# --- the client address behind trusted proxies ---------------------------------------


def parse_networks(entries: Sequence[str]) -> tuple[Network, ...]:
    """IP addresses and CIDR blocks (``10.0.0.0/8``, ``::1``) as networks."""
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries)


def _trusted(address: str, networks: Sequence[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False
    return any(ip in network for network in networks)


def client_address(peer: str, forwarded_for: Sequence[str], networks: Sequence[Network]) -> str:
    """The client's address: the right-most ``X-Forwarded-For`` hop that is not a trusted
    proxy, when ``peer`` is one; otherwise the peer itself."""
    if not networks or not _trusted(peer, networks):
        return peer
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, networks):
            return hop
    return hops[0] if hops else peer


class TrustedProxyMiddleware:
    """Rewrites ``scope["client"]`` and ``scope["scheme"]`` from forwarding headers sent by a
    trusted proxy; from anyone else they are ignored."""

    def __init__(self, app: ASGIApp, *, trusted: Sequence[str]) -> None:
        self.app = app
        self.networks = parse_networks(trusted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.networks:
            client = scope.get("client")
            if client and _trusted(client[0], self.networks):
                headers = scope.get("headers", ())
                hops = [v.decode("latin-1") for k, v in headers if k == b"x-forwarded-for"]
                protos = [v.decode("latin-1") for k, v in headers if k == b"x-forwarded-proto"]
                scope = dict(scope)
                if hops:
                    scope["client"] = (client_address(client[0], hops, self.networks), 0)
                if protos:
                    proto = protos[-1].split(",")[-1].strip().lower()
                    if proto in ("http", "https"):
                        scope["scheme"] = proto
        await self.app(scope, receive, send)


# --- the uvicorn server ------------------------------------------------------------


@dataclass(frozen=True)
class ServerLimits:
    """Connection limits of a uvicorn server."""

    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    limit_concurrency: int | None = 1000
    backlog: int = 2048
    max_head_bytes: int = 16384


RawResponder = Callable[[int, bytes, Sequence[tuple[bytes, bytes]]], None]


class RawRoute(Protocol):
    """A ``POST`` route the server's protocol answers itself (see the module doc).

    ``handle`` runs on the event loop with the whole body; it must not block, and it
    answers through ``respond(status, json_body, extra_headers)`` exactly once, on the
    loop, now or later (the protocol adds the status line, content type and length).
    """

    path: bytes  # the exact request target, e.g. b"/v1/frames"
    max_bytes: int  # a larger declared body goes the ASGI way, which refuses it

    def accepts(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether a request with these (lower-cased) headers is this route's."""
        ...

    def handle(self, body: bytes, respond: RawResponder) -> None: ...


class _NobodyWaits:
    """The ``message_event`` of a raw-route request: no ASGI task waits on it."""

    def set(self) -> None:
        pass


class _RawCycle:
    """A raw-route request in flight, with the attributes uvicorn's protocol reads of
    its request cycles (a pipelined request waits for it; shutdown and a lost
    connection mark it)."""

    __slots__ = ("body", "disconnected", "keep_alive", "response_complete")
    message_event = _NobodyWaits()

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True


def header_limits_protocol(
    timeout_s: float, max_head_bytes: int, raw_route: RawRoute | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (llhttp, in C: a fraction of the CPU per request of
    the pure-Python h11 parser, which the frame upload pays on every frame) with the
    request head held to limits: a connection whose head is not complete within ``timeout_s``
    of the connection or of the previous response is closed, and a head over
    ``max_head_bytes`` is answered 431 and its connection closed. With ``raw_route``,
    the requests that fit it are answered by the protocol itself (``RawRoute``)."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class HeaderLimitsProtocol(HttpToolsProtocol):
        header_timeout_s = timeout_s
        head_limit = max_head_bytes
        _head_timer: asyncio.TimerHandle | None = None
        # Between requests, or inside a request's head: the next bytes are a head's.
        _in_head = True
        _head_bytes = 0

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        _head_size = 0  # the parsed head's URL and headers so far
        _head_too_large = False

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            # A head still incomplete past the limit (a complete one is counted as parsed).
            too_long = self._in_head and self._head_bytes > self.head_limit
            if too_long and not self.transport.is_closing():
                self._refuse_head()

        def _grow_head(self, size: int) -> None:
            self._head_size += size
            if self._head_size > self.head_limit:
                self._head_too_large = True
                # The parser stops and uvicorn answers a parse error: 431 (send_400_response).
                raise ValueError("request head too large")

        def on_url(self, url: bytes) -> None:
            self._grow_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._grow_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            if self._head_too_large:
                self._refuse_head()
            else:
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            message = (
                f"request head over {self.head_limit} bytes: send a shorter request line"
                " and fewer or shorter headers"
            ).encode("ascii")
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(message), message)
            )
            self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()  # the head is complete
            if raw_route is not None and self._fits_raw_route(raw_route):
                # What uvicorn's own checks read meanwhile (it quacks like their cycles).
                self.cycle = _RawCycle()  # type: ignore[assignment]
                return
            super().on_headers_complete()

        def _fits_raw_route(self, route: RawRoute) -> bool:
            if self.url != route.path or self.parser.get_method() != b"POST":
                return False
            if self.parser.get_http_version() != "1.1" or not self.parser.should_keep_alive():
                return False
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return False  # a pipelined request: it waits its turn the ASGI way
            limit = self.limit_concurrency
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
                return False  # uvicorn answers 503
            if self.expect_100_continue:
                return False
            length: bytes | None = None
            for name, value in self.headers:
                if name == b"content-length":
                    if length is not None:
                        return False
                    length = value
                elif name == b"transfer-encoding":
                    return False
            if length is None or not length.isdigit() or int(length) > route.max_bytes:
                return False
            return route.accepts(self.headers)

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if isinstance(cycle, _RawCycle):
                cycle.body.append(body)  # at most the route's limit: Content-Length said so
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if isinstance(cycle, _RawCycle):
                body = cycle.body[0] if len(cycle.body) == 1 else b"".join(cycle.body)
                cycle.body = []
                assert raw_route is not None
                raw_route.handle(body, functools.partial(self._raw_respond, cycle))
            else:
                super().on_message_complete()
            # What follows is the next request's head.
            self._in_head, self._head_bytes, self._head_size = True, 0, 0

        def _raw_respond(
            self,
            cycle: _RawCycle,
            status: int,
            body: bytes,
            headers: Sequence[tuple[bytes, bytes]] = (),
        ) -> None:
            """Answer a raw-route request (on the loop, once), then go on as uvicorn does."""
            if cycle.response_complete:
                return
            cycle.response_complete = True
            if cycle.disconnected or self.transport.is_closing():
                return
            keep_alive = cycle.keep_alive  # False once the server is shutting down
            head = [STATUS_LINE[status]]
            for name, value in (*self.server_state.default_headers, *headers):
                head += (name, b": ", value, b"\r\n")
            head += (
                b"content-type: application/json\r\ncontent-length: ",
                str(len(body)).encode("ascii"),
                b"\r\n\r\n" if keep_alive else b"\r\nconnection: close\r\n\r\n",
                body,
            )
            self.transport.write(b"".join(head))  # one write: head and body together
            if not keep_alive:
                self.transport.close()
                return
            self.on_response_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_head and not self.transport.is_closing():
                self._arm()  # the next request's head is held to the same time

    return HeaderLimitsProtocol


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    limits: ServerLimits,
    raw_route: RawRoute | None = None,
    **options: Any,
) -> Any:
    """A ``uvicorn.Config`` for ``app`` with ``limits``; forwarding headers are left to
    ``TrustedProxyMiddleware`` (uvicorn's own would trust loopback peers). The requests
    that fit ``raw_route`` are answered by it, outside ``app`` (``RawRoute``)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_limits_protocol(limits.header_timeout_s, limits.max_head_bytes, raw_route),
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=limits.limit_concurrency,
        backlog=limits.backlog,
        proxy_headers=False,
        **options,
    )
