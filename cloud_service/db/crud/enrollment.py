"""Agent enrollment: one-time tokens, spending them, and the agents' API tokens (stored hashed)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, EnrollmentToken
from cloud_service.errors import AuthError, ConflictError

__all__ = [
    "ENROLL_RETRY_S",
    "agent_for_api_token",
    "create_enrollment_token",
    "enroll_agent",
    "hash_token",
]


def hash_token(token: str) -> str:
    """sha256 of a bearer token (tokens are random and long, so no salt is needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_enrollment_token(
    *, session: Session, fleet: str, agent_id: str | None, ttl_s: int, now: datetime | None = None
) -> tuple[str, datetime]:
    """A new one-time token (returned once, stored hashed) and when it expires."""
    token = "elt_" + secrets.token_urlsafe(32)
    expires_at = (now or datetime.now(UTC)) + timedelta(seconds=ttl_s)
    session.add(
        EnrollmentToken(
            token_hash=hash_token(token), fleet=fleet, agent_id=agent_id, expires_at=expires_at
        )
    )
    return token, expires_at


# How long the agent that spent a token may spend it again (a retry after a lost answer).
ENROLL_RETRY_S = 300.0


def enroll_agent(
    *, session: Session, token: str, agent_id: str | None, now: datetime | None = None
) -> tuple[Agent, str]:
    """Spend a one-time token: create or re-key the agent; return it and its new API token."""
    now = now or datetime.now(UTC)
    record = session.scalars(
        select(EnrollmentToken)
        .where(EnrollmentToken.token_hash == hash_token(token))
        # Row lock on PostgreSQL: two enrollments racing on one token, one wins.
        .with_for_update()
    ).first()
    if record is None:
        raise AuthError("enrollment token is not known: ask an admin for a new one")
    if record.used_at is not None and not (
        # The same agent asking again soon after: its answer was most likely lost on the
        # way (a dropped connection, an API restart after the commit). It is re-keyed;
        # the credentials of the lost answer stop working.
        (agent_id or record.agent_id) is not None
        and record.used_by == (agent_id or record.agent_id)
        and now - record.used_at <= timedelta(seconds=ENROLL_RETRY_S)
    ):
        raise ConflictError("enrollment token was already used: ask an admin for a new one")
    if record.used_at is None and record.expires_at <= now:
        raise AuthError(f"enrollment token expired at {record.expires_at.isoformat()}")
    if record.agent_id is not None and agent_id is not None and agent_id != record.agent_id:
        raise ConflictError(
            f"this token enrolls agent {record.agent_id!r}, not {agent_id!r}: omit agent_id"
            " or use the one the token was made for"
        )
    chosen = record.agent_id or agent_id or f"agent-{secrets.token_hex(4)}"
    agent = session.get(Agent, chosen)
    if agent is not None and agent.fleet != record.fleet:
        raise ConflictError(f"agent {chosen!r} belongs to another fleet")
    if agent is None:
        agent = Agent(agent_id=chosen, fleet=record.fleet, telemetry={}, state="enrolled")
        session.add(agent)
    api_token = "ela_" + secrets.token_urlsafe(32)
    agent.api_token_hash = hash_token(api_token)
    agent.enrolled_at = now
    if record.used_at is None:  # a retry does not move the window
        record.used_at = now
    record.used_by = chosen
    return agent, api_token


def agent_for_api_token(*, session: Session, token: str) -> Agent | None:
    return session.scalars(select(Agent).where(Agent.api_token_hash == hash_token(token))).first()
