"""The uvicorn server both HTTP servers (the cloud API, the edge agent's local API) run.

- ``server_config``: the uvicorn configuration both run with: a request head must be
  complete within ``header_timeout_s`` of the connection (or of the previous
  response), idle keep-alive connections close, connections and head sizes are bounded.
- ``RawRoute``: one hot ``POST`` route a server's protocol answers itself, with no ASGI
  task, scope, middleware or message dicts (the edge agent's frame uploads). Only a
  request that needs none of what those give goes that way: HTTP/1.1, keep-alive, the
  route's exact path with no query, a ``Content-Length`` within the route's limit (so
  the body cannot pass it), no ``Transfer-Encoding`` or ``Expect``, nothing else in
  flight on the connection, and a head the route accepts; every other request,
  refusals of oversized bodies included, takes the ASGI path (and
  ``shared.http_limits``'s middleware) as before.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["RawResponder", "RawRoute", "ServerLimits", "header_limits_protocol", "server_config"]


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
            # What follows is the next request's head: held to the time limit from the
            # answer on, which a raw route may give at once, inside ``handle``.
            cycle = self.cycle
            if not isinstance(cycle, _RawCycle):
                super().on_message_complete()
                self._in_head, self._head_bytes, self._head_size = True, 0, 0
                return
            self._in_head, self._head_bytes, self._head_size = True, 0, 0
            body = cycle.body[0] if len(cycle.body) == 1 else b"".join(cycle.body)
            cycle.body = []
            assert raw_route is not None  # only a raw route makes a _RawCycle
            raw_route.handle(body, functools.partial(self._raw_respond, cycle))

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
