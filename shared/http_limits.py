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

The uvicorn server both run with (connection and head limits) is ``shared.http_server``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

__all__ = [
    "BodyRule",
    "Gate",
    "HttpLimitsMiddleware",
    "Refusal",
    "TrustedProxyMiddleware",
    "client_address",
    "parse_networks",
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
