"""HTTP hardening of the cloud API: rate limits on abuse-prone routes and security headers.

- ``RateLimiter``: a token bucket per (route group, client). Groups: ``enroll``
  (``POST /v1/enroll``, ``/v1/enrollment-tokens``), ``login`` (``POST /ui/login``) and
  ``upload`` (``POST /v1/models``, ``/v2/models/*/infer``, labels). The client is the
  peer address (``scope["client"]``; behind a reverse proxy listed in
  ``settings.trusted_proxies``, the address it forwards: shared/http_limits.py). A request
  whose bearer token authenticates (the admin token, an enrolled agent's API token)
  is charged to that principal instead, so agents behind one NAT do not starve each
  other; a token that does not authenticate is charged to the address, so inventing
  tokens buys no fresh buckets. Over the limit: ``429`` with ``Retry-After``.
- ``SecurityHeaders``: CSP (scripts from this origin plus the hashes of the UI's
  own inline bootstrap scripts, no inline styles, no framing), ``nosniff``,
  ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer``, no caching of API answers.

- ``CredentialGate``: the gate of ``shared.http_limits.HttpLimitsMiddleware``; a request
  to a route that needs credentials is refused before its body is read when it carries
  none that pass (the route's own dependency still checks in full); /v2, the API docs
  and /metrics need credentials as the settings say (``v2_auth``, ``docs_public``,
  ``metrics_auth``).
- Cookies are marked ``Secure`` when the settings say so (``cookie_secure``) or the
  request came over HTTPS (directly, or through a trusted proxy).

All are plain ASGI middleware (no per-request task switching of BaseHTTPMiddleware).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Counter
from starlette.concurrency import run_in_threadpool

from cloud_service.ui.auth import SESSION_COOKIE
from shared.http_limits import Refusal

__all__ = [
    "DOCS_PATHS",
    "Authenticate",
    "CredentialGate",
    "RateLimitMiddleware",
    "RateLimiter",
    "SecurityHeadersMiddleware",
    "content_policy",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ASGIApp = Callable[[Scope, Receive, Send], Any]
Authenticate = Callable[[str], str | None]
"""A bearer token to the principal it authenticates ("admin", "agent:fleet/id"), else None."""

log = logging.getLogger(__name__)

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
    """Adds the security headers to every HTTP response; marks cookies ``Secure`` when
    ``secure_cookies`` or when the request came over HTTPS."""

    def __init__(self, app: ASGIApp, *, secure_cookies: bool = False) -> None:
        self.app = app
        self.secure_cookies = secure_cookies
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
        secure = self.secure_cookies or scope.get("scheme") == "https"

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                extra = [(k, v) for k, v in self.headers if k not in present]
                if path.startswith(("/v1/", "/v2/")) and b"cache-control" not in present:
                    extra.append((b"cache-control", b"no-store"))
                if secure and b"set-cookie" in present:
                    headers = [_secured(k, v) for k, v in headers]
                message["headers"] = [*headers, *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _secured(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    if name.lower() != b"set-cookie" or re.search(rb";\s*secure\s*(;|$)", value, re.I):
        return name, value
    return name, value + b"; Secure"


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


# --- credentials before the body (shared/http_limits.py HttpLimitsMiddleware's gate) ---

AuthKind = Literal["admin", "agent_or_admin", "session", "docs", "metrics"]
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def route_auth_kind(route: Any) -> AuthKind | None:
    """The credential a route's dependencies ask for, else None."""
    from cloud_service.ui.deps import admin_user, check_csrf, current_user
    from cloud_service.web.deps import require_admin, require_agent_or_admin

    kinds: dict[Any, AuthKind] = {
        require_admin: "admin",
        require_agent_or_admin: "agent_or_admin",
        current_user: "session",
        admin_user: "session",
        check_csrf: "session",
    }

    def needed(dependant: Any) -> AuthKind | None:
        found = kinds.get(dependant.call)
        if found is not None:
            return found
        for child in dependant.dependencies:
            found = needed(child)
            if found is not None:
                return found
        return None

    dependant = getattr(route, "dependant", None)
    return None if dependant is None else needed(dependant)


class CredentialGate:
    """Refuses a request whose route needs credentials it does not carry, before its body
    is read: the admin token, an agent's API token, or a signed UI session cookie, as the
    route's own dependency asks for (which still checks in full afterwards). /v2, the API
    docs and /metrics are refused here alone, as the settings say.

    ``principal`` (blocking; run in a worker thread) names who a bearer token is.
    """

    def __init__(
        self,
        *,
        admin_token: str,
        principal: Authenticate,
        session_valid: Callable[[str], bool],
        v2_auth: bool,
        docs_public: bool,
        metrics_auth: bool,
        metrics_token: str | None = None,
    ) -> None:
        self.admin_token = admin_token.encode()
        self.metrics_token = metrics_token.encode() if metrics_token else None
        self.principal = principal
        self.session_valid = session_valid
        self.v2_auth = v2_auth
        self.docs_public = docs_public
        self.metrics_auth = metrics_auth
        self._kinds: dict[int, AuthKind | None] = {}

    def path_kind(self, scope: Scope) -> AuthKind | None:
        """What a path needs whatever its route: /v2, the docs, /metrics."""
        path: str = scope.get("path", "")
        if path in DOCS_PATHS:
            return None if self.docs_public else "docs"
        if path == "/metrics":
            return "metrics" if self.metrics_auth else None
        if path == "/v2" or path.startswith("/v2/"):
            return "agent_or_admin" if self.v2_auth else None
        return None

    def route_kind(self, scope: Scope) -> AuthKind | None:
        """What the matched route (``scope["route"]``, set by routing) asks for."""
        route = scope.get("route")
        if route is None:
            return None
        key = id(route)
        if key not in self._kinds:
            self._kinds[key] = route_auth_kind(route)
        return self._kinds[key]

    def _is_admin(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.admin_token)

    async def allowed(self, kind: AuthKind, scope: Scope) -> bool:
        token = _bearer_token(scope)
        if kind == "session":
            return self.session_valid(_cookie(scope, SESSION_COOKIE) or "")
        if self._is_admin(token):
            return True
        if kind == "docs":
            return self.session_valid(_cookie(scope, SESSION_COOKIE) or "")
        if kind == "metrics":
            expected = self.metrics_token
            return bool(token and expected and hmac.compare_digest(token.encode(), expected))
        if kind == "agent_or_admin" and token:
            return await run_in_threadpool(self.principal, token) is not None
        return False

    async def __call__(self, scope: Scope) -> Refusal | None:
        """Up front, for the paths that need credentials whatever their route."""
        return await self._check(self.path_kind(scope), scope)

    async def before_body(self, scope: Scope) -> Refusal | None:
        """When the matched route first reads the body."""
        return await self._check(self.route_kind(scope), scope)

    async def _check(self, kind: AuthKind | None, scope: Scope) -> Refusal | None:
        if kind is None:
            return None
        try:
            if await self.allowed(kind, scope):
                return None
        except Exception as exc:  # the credential store is away
            log.warning("could not check credentials before the body: %s", exc)
            return Refusal(
                503,
                {"detail": "credentials cannot be checked now; retry", "reason": "unavailable"},
                ((b"retry-after", b"5"),),
            )
        return _unauthenticated(kind, scope)


_BEARER = ((b"www-authenticate", b"Bearer"),)
_NEEDS = {
    "admin": "this endpoint needs the admin token: send 'Authorization: Bearer <token>'",
    "agent_or_admin": "send 'Authorization: Bearer <token>': the agent's API token or the admin's",
    "docs": "the API documentation needs the admin token or a signed-in review UI session",
    "metrics": "/metrics needs the metrics token (or the admin token) as a bearer token",
}


def _unauthenticated(kind: AuthKind, scope: Scope) -> Refusal:
    path: str = scope.get("path", "")
    if kind == "session":
        accept = (_header(scope, b"accept") or b"").decode("latin-1")
        if path.startswith("/ui/api/") or "application/json" in accept:
            body = {"detail": "your session expired or you are not signed in", "reason": "login"}
            return Refusal(401, body)
        # A page's form: to the login page, as the UI's own handler sends it.
        return Refusal(
            303,
            {"detail": "sign in first", "reason": "login"},
            ((b"location", b"/ui/login?next=/ui/queue"),),
        )
    message = _NEEDS[kind]
    if path == "/v2" or path.startswith("/v2/"):
        return Refusal(401, {"error": message}, _BEARER)
    return Refusal(401, {"detail": message, "reason": "unauthorized"}, _BEARER)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value)
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                cookie_name, _, cookie_value = part.strip().partition("=")
                if cookie_name == name:
                    return cookie_value
    return None
