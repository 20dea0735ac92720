"""HTTP hardening of the cloud API: rate limits on abuse-prone routes and security headers.

- ``RateLimiter``: a token bucket per (route group, client). Groups: ``enroll``
  (``POST /v1/enroll``, ``/v1/enrollment-tokens``), ``login`` (``POST /ui/login``) and
  ``upload`` (``POST /v1/models``, ``/v2/models/*/infer``, labels). The client is the
  peer address (``scope["client"]``; behind a proxy, let the server rewrite it from
  trusted forwarding headers, e.g. uvicorn's ``--forwarded-allow-ips``). A request
  whose bearer token authenticates (the admin token, an enrolled agent's API token)
  is charged to that principal instead, so agents behind one NAT do not starve each
  other; a token that does not authenticate is charged to the address, so inventing
  tokens buys no fresh buckets. Over the limit: ``429`` with ``Retry-After``.
- ``SecurityHeaders``: CSP (scripts from this origin plus the hashes of the UI's
  own inline bootstrap scripts, no inline styles, no framing), ``nosniff``,
  ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``, no caching of API answers.

Both are plain ASGI middleware (no per-request task switching of BaseHTTPMiddleware).
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from starlette.concurrency import run_in_threadpool

__all__ = [
    "Authenticate",
    "RateLimitMiddleware",
    "RateLimiter",
    "SecurityHeadersMiddleware",
    "content_policy",
]

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ASGIApp = Callable[[Scope, Receive, Send], Any]
Authenticate = Callable[[str], str | None]
"""A bearer token to the principal it authenticates ("admin", "agent:fleet/id"), else None."""

_TEMPLATES = Path(__file__).parent / "ui" / "templates"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)


def _inline_script_hashes() -> list[str]:
    """CSP hashes of the inline ``<script>`` bodies in the UI templates (no 'unsafe-inline')."""
    hashes: set[str] = set()
    for path in sorted(_TEMPLATES.glob("*.html")):
        for body in _INLINE_SCRIPT.findall(path.read_text()):
            if "{{" in body or "{%" in body:
                continue  # templated: its text varies, so no fixed hash can allow it
            digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
            hashes.add(f"'sha256-{digest}'")
    return sorted(hashes)


def content_policy() -> str:
    scripts = " ".join(["'self'", *_inline_script_hashes()])
    return (
        "default-src 'self'; "
        f"script-src {scripts}; "
        "style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    )


class SecurityHeadersMiddleware:
    """Adds the security headers to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers = [
            (b"content-security-policy", content_policy().encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"no-referrer"),
            (b"cross-origin-opener-policy", b"same-origin"),
            (b"permissions-policy", b"camera=(), microphone=(), geolocation=()"),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.headers if k not in present]
                if path.startswith(("/v1/", "/v2/")) and b"cache-control" not in present:
                    extra.append((b"cache-control", b"no-store"))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class RateLimiter:
    """Token buckets keyed by string; ``rate_per_min`` refill, ``burst`` capacity."""

    def __init__(
        self,
        rate_per_min: float,
        burst: int,
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_min / 60.0
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0.0 when allowed, else the seconds until a token is free."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                tokens -= 1.0
                wait = 0.0
            else:
                wait = (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)  # forget the least recently seen client
            return wait


def _group(method: str, path: str) -> str | None:
    if method != "POST":
        return None
    if path in ("/v1/enroll", "/v1/enrollment-tokens"):
        return "enroll"
    if path == "/ui/login":
        return "login"
    if path == "/v1/models" or path.startswith("/v2/models/") or path.endswith("/labels"):
        return "upload"
    return None


class RateLimitMiddleware:
    """Answers 429 with Retry-After once a client's bucket for a route group is empty.

    ``authenticate`` (blocking; run in a worker thread) names the principal a bearer
    token belongs to. It is asked only for requests in a limited group.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limits: dict[str, tuple[float, int]],
        refused: Counter | None = None,
        authenticate: Authenticate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.limiters = {
            group: RateLimiter(rate, burst, clock=clock)
            for group, (rate, burst) in limits.items()
            if rate > 0
        }
        self.refused = refused
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            group = _group(scope.get("method", ""), scope.get("path", ""))
            limiter = self.limiters.get(group) if group else None
            if limiter is not None and group is not None:
                wait = limiter.take(await self.client_key(scope))
                if wait > 0:
                    if self.refused is not None:
                        self.refused.labels(group).inc()
                    await _too_many(send, group, wait)
                    return
        await self.app(scope, receive, send)

    async def client_key(self, scope: Scope) -> str:
        """``principal:<name>`` for a bearer token that authenticates, else ``addr:<peer>``."""
        token = _bearer_token(scope)
        if token and self.authenticate is not None:
            principal = await run_in_threadpool(self.authenticate, token)
            if principal:
                return f"principal:{principal}"
        client = scope.get("client") or ("unknown", 0)
        return f"addr:{client[0]}"


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


async def _too_many(send: Send, group: str, wait: float) -> None:
    body = (
        '{"detail":"too many ' + group + ' requests from this client: retry later",'
        '"reason":"rate_limited"}'
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"retry-after", str(max(1, math.ceil(wait))).encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
