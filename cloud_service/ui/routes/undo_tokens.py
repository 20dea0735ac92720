"""Signed undo notes of bulk discards: who discarded which samples, when, and their statuses."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
import time
import uuid

from cloud_service.ui import store
from cloud_service.ui.deps import UiUser
from cloud_service.web.state import ApiState
from shared.errors import ContractError

__all__ = ["UNDO_TTL_S", "make_undo_token", "read_undo_token"]

UNDO_TTL_S = 3600.0  # a bulk discard can be undone for this long


def _undo_key(state: ApiState) -> bytes:
    secret = state.settings.session_secret.get_secret_value().encode()
    return hashlib.sha256(b"edgeloop-ui-bulk-undo\0" + secret).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_undo_token(state: ApiState, user: UiUser, done: list[tuple[str, str]]) -> str:
    """A signed note of what a bulk discard changed: the user, when, each sample's status."""
    body = struct.pack(">IQ", user.id, int(time.time()))
    for sample_id, previous in done:
        body += uuid.UUID(sample_id).bytes + bytes([store.SAMPLE_STATUSES.index(previous)])
    mac = hmac.new(_undo_key(state), body, hashlib.sha256).digest()[:16]
    return f"{_b64(body)}.{_b64(mac)}"


def read_undo_token(state: ApiState, user: UiUser, token: str) -> list[tuple[str, str]]:
    problem = ContractError("this undo is not valid any more; reload the queue", reason="invalid")
    body_text, _, mac_text = token.partition(".")
    try:
        body = base64.urlsafe_b64decode(body_text + "=" * (-len(body_text) % 4))
        mac = base64.urlsafe_b64decode(mac_text + "=" * (-len(mac_text) % 4))
    except ValueError as exc:
        raise problem from exc
    expected = hmac.new(_undo_key(state), body, hashlib.sha256).digest()[:16]
    if len(body) < 12 or (len(body) - 12) % 17 or not hmac.compare_digest(mac, expected):
        raise problem
    user_id, issued = struct.unpack(">IQ", body[:12])
    if user_id != user.id:
        raise ContractError("only the reviewer who discarded these samples can undo it")
    if time.time() - issued > UNDO_TTL_S:
        raise ContractError(f"an undo lasts {UNDO_TTL_S / 60:.0f} minutes; this one expired")
    items = []
    for at in range(12, len(body), 17):
        sample_id = str(uuid.UUID(bytes=body[at : at + 16]))
        index = body[at + 16]
        if index >= len(store.SAMPLE_STATUSES):
            raise problem
        items.append((sample_id, store.SAMPLE_STATUSES[index]))
    return items
