"""What an announcement must pass before anything is downloaded: signature, freshness, fit.

In order: the signature over the manifest as received (the fleet key the agent was
enrolled with); freshness (its signed ``sequence`` above the highest this agent
accepted on that topic, the same sequence only for the same bytes; its
``expires_at`` not past; its ``fleet``/``agent`` this agent and topic); and the
compatibility of the manifest (opset, runtime version, input spec). A refusal is an
:class:`UpdateRefused` whose ``reason`` is the slug published on ``model-status``.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import datetime
from typing import Any, Literal

from edge_agent.settings import AgentSettings
from shared.errors import EdgeLoopError, MessageError, SignatureError
from shared.manifest import ModelManifest, agent_refusal
from shared.messages import ModelAnnouncement, decode_message, verify_manifest_bytes
from shared.onnx_support import max_supported_opset, runtime_version

__all__ = [
    "Scope",
    "UpdateRefused",
    "announced_names",
    "check_compatible",
    "check_fresh",
    "verify_announcement",
]

log = logging.getLogger(__name__)

Scope = Literal["fleet", "agent"]
_MAX_ANNOUNCEMENT = 1 << 22


class UpdateRefused(EdgeLoopError):
    """An update failed a check; ``reason`` is the slug published on model-status."""

    def __init__(self, reason: str, message: str, *, transient: bool = False) -> None:
        super().__init__(message, reason=reason)
        self.transient = transient


def verify_announcement(settings: AgentSettings, raw: bytes) -> ModelManifest:
    """The manifest of an announcement signed with this agent's fleet key."""
    key = settings.fleet_public_key
    if not key:
        raise UpdateRefused("no_fleet_key", "this agent has no fleet public key (enroll it)")
    try:
        return verify_manifest_bytes(raw, key, max_bytes=settings.max_announcement_bytes)
    except SignatureError as exc:
        raise UpdateRefused("bad_signature", exc.message) from exc
    except MessageError as exc:
        raise UpdateRefused("malformed", exc.message) from exc
    except EdgeLoopError as exc:  # a malformed fleet key is our configuration
        raise UpdateRefused("no_fleet_key", exc.message) from exc


def check_fresh(
    settings: AgentSettings,
    manifest: ModelManifest,
    raw: bytes,
    scope: Scope,
    *,
    seen: dict[str, Any],
    now: datetime,
) -> dict[str, Any] | None:
    """Refuse a replayed, expired or misdirected announcement.

    ``seen`` is what was last accepted on ``scope``'s topic. Returns what to remember
    for that topic once this one is accepted, or None when there is nothing new (the
    same announcement again, or one without a sequence accepted in development).
    """
    if manifest.fleet is not None and manifest.fleet != settings.fleet:
        raise UpdateRefused(
            "wrong_audience",
            f"announcement is for fleet {manifest.fleet}, this agent is in {settings.fleet}",
        )
    if scope == "agent" and manifest.agent is not None and manifest.agent != settings.agent_id:
        raise UpdateRefused(
            "wrong_audience", f"announcement is for agent {manifest.agent}, not this agent"
        )
    if scope == "agent" and manifest.agent is None and manifest.sequence is not None:
        raise UpdateRefused("wrong_audience", "a fleet announcement came on this agent's own topic")
    if scope == "fleet" and manifest.agent is not None:
        raise UpdateRefused(
            "wrong_audience",
            f"a per-agent announcement (for {manifest.agent}) came on the fleet topic",
        )
    if manifest.expires_at is not None and manifest.expires_at <= now:
        raise UpdateRefused("expired", f"announcement expired at {manifest.expires_at.isoformat()}")
    if manifest.sequence is None:
        if settings.env == "production":
            raise UpdateRefused(
                "unsequenced",
                "announcement has no sequence (a cloud older than this agent); upgrade the cloud",
            )
        log.warning(
            "announcement of %s %s has no sequence (an older cloud): accepted in development",
            manifest.name,
            manifest.version,
        )
        return None
    digest = hashlib.sha256(_signed_part(raw)).hexdigest()
    highest = seen.get("sequence")
    if isinstance(highest, int):
        if manifest.sequence < highest or (
            manifest.sequence == highest and seen.get("digest") != digest
        ):
            raise UpdateRefused(
                "stale",
                f"announcement sequence {manifest.sequence} is not newer than"
                f" {highest}, the highest accepted on the {scope} topic (a replay?)",
            )
        if manifest.sequence == highest:
            return None  # the same announcement again (a broker redelivery)
    return {"sequence": manifest.sequence, "digest": digest}


def check_compatible(
    settings: AgentSettings,
    manifest: ModelManifest,
    input_hw: tuple[int, int],
    task: str | None = None,
) -> None:
    """Refuse a model this agent cannot serve in place of one taking ``input_hw`` frames
    and answering ``task``."""
    # The same check the registry runs on this agent's heartbeat before it announces.
    refusal = agent_refusal(
        manifest,
        input_hw=input_hw,
        max_opset=settings.max_model_opset or max_supported_opset(),
        runtime_version=runtime_version(),
        task=task,
    )
    if refusal is not None:
        raise UpdateRefused(*refusal)


def _signed_part(raw: bytes) -> bytes:
    """The manifest object of an announcement as received (what its signature covers)."""
    try:
        return decode_message(raw, ModelAnnouncement, max_bytes=_MAX_ANNOUNCEMENT).signed_bytes()
    except (MessageError, ValueError):
        return raw


def announced_names(raw: bytes) -> tuple[str, str]:
    """Name and version of an announcement before it is trusted (for refusal reports)."""
    try:
        manifest = decode_message(raw, ModelAnnouncement, max_bytes=_MAX_ANNOUNCEMENT).manifest
        return manifest.name, manifest.version
    except (MessageError, ValueError):
        return "", ""
