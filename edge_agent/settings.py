"""The edge agent's one settings object."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

from pydantic import Field, field_validator

from shared.errors import InvalidIdError
from shared.settings import EdgeLoopSettings
from shared.topics import validate_id

__all__ = ["AgentSettings", "default_agent_id"]


def default_agent_id() -> str:
    """The host name, lowered and reduced to the characters an agent id accepts."""
    name = re.sub(r"[^a-z0-9_-]+", "-", socket.gethostname().lower()).strip("-_")
    return (name or "agent")[:64]


def _as_value_error(check: Callable[[str, str], str], value: str, kind: str) -> str:
    # pydantic reports ValueErrors with the field's name; our own errors would escape raw.
    try:
        return check(value, kind)
    except InvalidIdError as exc:
        raise ValueError(exc.message) from exc


class AgentSettings(EdgeLoopSettings):
    """Settings of one edge agent (``EDGELOOP_*``; see README's configuration reference)."""

    fleet: str = "default"
    agent_id: str = Field(default_factory=default_agent_id)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8081, ge=1, le=65535)
    fleet_public_key: str | None = Field(
        default=None, description="base64 ed25519 key that signs this fleet's models"
    )

    @field_validator("fleet")
    @classmethod
    def _check_fleet(cls, value: str) -> str:
        return _as_value_error(validate_id, value, "fleet")

    @field_validator("agent_id")
    @classmethod
    def _check_agent(cls, value: str) -> str:
        return _as_value_error(validate_id, value, "agent")

    def production_problems(self) -> list[str]:
        problems = super().production_problems()
        if not self.fleet_public_key:
            problems.append(
                "no fleet public key: the agent could not verify model updates "
                "(run `edge-agent enroll` or set EDGELOOP_FLEET_PUBLIC_KEY)"
            )
        return problems
