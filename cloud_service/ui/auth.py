"""Passwords, signed session cookies and CSRF tokens of the review UI (stdlib only).

- Passwords: ``cloud_service.passwords`` (scrypt), re-exported here.
- Sessions: ``base64url(json).base64url(hmac_sha256)`` keyed by a key derived from
  ``settings.session_secret``; the payload holds the user id, the user's session
  generation (a password change ends older sessions), issue and expiry times, and a
  random nonce from which the session's CSRF token is derived.
- CSRF: ``hmac(key, "csrf:" + nonce)``; forms send it as ``csrf_token``, fetch as
  the ``X-CSRF-Token`` header. The login form, which has no session yet, uses a
  double-submit cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from cloud_service.passwords import MIN_PASSWORD_LENGTH, hash_password, verify_password

__all__ = [
    "MIN_PASSWORD_LENGTH",
    "SESSION_COOKIE",
    "SessionData",
    "SessionSigner",
    "hash_password",
    "verify_password",
]

SESSION_COOKIE = "edgeloop_session"
LOGIN_CSRF_COOKIE = "edgeloop_login_csrf"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class SessionData:
    """What a valid session cookie says."""

    user_id: int
    generation: int
    issued_at: float
    expires_at: float
    nonce: str


class SessionSigner:
    """Signs and checks session cookies and derives CSRF tokens from one secret."""

    def __init__(self, secret: str, *, ttl_s: float = 8 * 3600) -> None:
        # A key of its own, so the raw secret is never used for two purposes.
        self._key = hashlib.sha256(b"edgeloop-ui-session\0" + secret.encode()).digest()
        self.ttl_s = ttl_s

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def sign(
        self, *, user_id: int, generation: int, now: float | None = None, ttl_s: float | None = None
    ) -> str:
        now = time.time() if now is None else now
        payload = {
            "u": user_id,
            "g": generation,
            "iat": int(now),
            "exp": int(now + (self.ttl_s if ttl_s is None else ttl_s)),
            "n": secrets.token_urlsafe(16),
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{_b64(self._mac(body.encode()))}"

    def load(self, cookie: str | None, *, now: float | None = None) -> SessionData | None:
        """The session in ``cookie``, or None when it is missing, forged or expired."""
        if not cookie or "." not in cookie:
            return None
        body, _, mac = cookie.partition(".")
        try:
            if not hmac.compare_digest(_unb64(mac), self._mac(body.encode())):
                return None
            payload = json.loads(_unb64(body))
            data = SessionData(
                user_id=int(payload["u"]),
                generation=int(payload["g"]),
                issued_at=float(payload["iat"]),
                expires_at=float(payload["exp"]),
                nonce=str(payload["n"]),
            )
        except (ValueError, KeyError, TypeError):
            return None
        if (time.time() if now is None else now) >= data.expires_at:
            return None
        return data

    def csrf_token(self, nonce: str) -> str:
        return _b64(self._mac(b"csrf:" + nonce.encode()))

    def check_csrf(self, nonce: str, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf_token(nonce), token or "")
