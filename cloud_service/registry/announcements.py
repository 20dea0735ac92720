"""What each fleet and agent is announced: promote, rollback, pins, signed announcements.

``fleet_models`` says which version a fleet's retained announcement names (and the
versions before it, for rollback); ``agent_overrides`` holds the per-agent retained
announcements of canary cohorts and pins. Every change is published (retained, QoS 1)
through the ``Announcer``; an override withdrawn is a zero-length retained message.
Each announcement is signed afresh with its freshness (sequence, expiry, fleet, agent);
the sequence rules are in ``cloud_service.registry`` (package docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import BigInteger, case, delete, insert, literal, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cloud_service.announce import Announcer
from cloud_service.db.models import AgentOverride, AnnouncementSequence, FleetModel, ModelVersion
from cloud_service.errors import ConflictError
from cloud_service.registry.refusals import check_agents
from cloud_service.registry.versions import get_version, require_servable
from shared.errors import ContractError
from shared.manifest import FleetSigningKey, ModelManifest
from shared.messages import encode_message, sign_manifest
from shared.topics import Topics, validate_id

__all__ = [
    "DEFAULT_ANNOUNCEMENT_TTL",
    "clear_overrides",
    "next_sequence",
    "pin",
    "promote",
    "refresh_announcements",
    "rollback",
    "serving",
    "set_overrides",
    "signed_announcement",
    "unpin",
]

# How long agents may act on a retained announcement. Long, because a fleet that is
# simply idle keeps its announcement retained: ``refresh_announcements`` signs it
# again once half of this has passed, and an agent that already serves the version
# named is not disturbed by an expired copy.
DEFAULT_ANNOUNCEMENT_TTL = timedelta(days=30)


def serving(*, session: Session, fleet: str) -> FleetModel | None:
    return session.get(FleetModel, fleet)


def next_sequence(*, session: Session, fleet: str, now: datetime | None = None) -> int:
    """The fleet's next announcement sequence: ``max(last + 1, now in ms)`` (see module doc)."""
    now_ms = int((now or datetime.now(UTC)).timestamp() * 1000)
    last = AnnouncementSequence.last_sequence
    bump = (
        update(AnnouncementSequence)
        .where(AnnouncementSequence.fleet == fleet)
        .values(last_sequence=_greatest(last + 1, now_ms), updated_at=datetime.now(UTC))
        .returning(last)
        .execution_options(synchronize_session=False)
    )
    for _attempt in range(2):
        value = session.execute(bump).scalar_one_or_none()
        if value is not None:
            return int(value)
        try:
            with session.begin_nested():  # another replica may insert the row first
                session.execute(
                    insert(AnnouncementSequence).values(
                        fleet=fleet, last_sequence=now_ms, updated_at=datetime.now(UTC)
                    )
                )
            return now_ms
        except IntegrityError:
            continue
    raise ConflictError(f"cannot allocate an announcement sequence for fleet {fleet}")


def _greatest(column: Any, value: int) -> Any:
    """SQL ``max(column, value)`` that SQLite and PostgreSQL both run."""
    bound = literal(value, type_=BigInteger())
    return case((column > bound, column), else_=bound)


def signed_announcement(
    *,
    session: Session,
    key: FleetSigningKey,
    record: ModelVersion,
    fleet: str,
    agent: str | None = None,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
    now: datetime | None = None,
) -> bytes:
    """The announcement bytes of ``record`` for a fleet (or one agent), freshly sequenced."""
    now = now or datetime.now(UTC)
    try:
        manifest = ModelManifest.model_validate(
            {
                **record.manifest,
                "sequence": next_sequence(session=session, fleet=fleet, now=now),
                "expires_at": (now + ttl).isoformat(),
                "fleet": fleet,
                "agent": agent,
            }
        )
    except ValidationError as exc:
        raise ConflictError(
            f"{record.name} {record.version} has no valid manifest to announce"
            f" ({exc.error_count()} problem(s)); register the model again",
            reason="invalid_manifest",
        ) from exc
    return encode_message(sign_manifest(manifest, key))


def refresh_announcements(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
    now: datetime | None = None,
) -> list[str]:
    """Sign again the retained announcements older than half ``ttl``; return their topics."""
    now = now or datetime.now(UTC)
    stale = now - ttl / 2
    refreshed: list[str] = []
    for current in session.scalars(select(FleetModel).where(FleetModel.updated_at < stale)):
        record = get_version(session=session, name=current.model_name, version=current.version)
        if record.state == "deleted":
            continue
        raw = signed_announcement(
            session=session, key=key, record=record, fleet=current.fleet, ttl=ttl, now=now
        )
        current.updated_at = now
        session.flush()
        topic = topics.fleet_models(current.fleet)
        announcer.announce(topic, raw)
        refreshed.append(topic)
    for override in session.scalars(select(AgentOverride).where(AgentOverride.created_at < stale)):
        record = get_version(session=session, name=override.model_name, version=override.version)
        if record.state == "deleted":
            continue
        raw = signed_announcement(
            session=session,
            key=key,
            record=record,
            fleet=override.fleet,
            agent=override.agent_id,
            ttl=ttl,
            now=now,
        )
        override.created_at = now
        session.flush()
        topic = topics.agent_models(override.fleet, override.agent_id)
        announcer.announce(topic, raw)
        refreshed.append(topic)
    return refreshed


def clear_overrides(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    agents: Sequence[str] | None = None,
    kind: str | None = None,
) -> list[str]:
    """Withdraw per-agent announcements (all of the fleet's, or these agents'); return ids."""
    stmt = select(AgentOverride).where(AgentOverride.fleet == fleet)
    if agents is not None:
        stmt = stmt.where(AgentOverride.agent_id.in_(list(agents)))
    if kind is not None:
        stmt = stmt.where(AgentOverride.kind == kind)
    cleared = [o.agent_id for o in session.scalars(stmt).all()]
    if cleared:
        session.execute(delete(AgentOverride).where(AgentOverride.agent_id.in_(cleared)))
    for agent in cleared:
        announcer.announce(topics.agent_models(fleet, agent), b"")
    return cleared


def set_overrides(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    record: ModelVersion,
    agents: Sequence[str],
    kind: str,
    key: FleetSigningKey,
    rollout_id: int | None = None,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> None:
    """Point these agents at ``record`` with a per-agent retained announcement."""
    require_servable(record)
    check_agents(session, record, agents=agents)
    for agent in agents:
        validate_id(agent, "agent")
        override = session.get(AgentOverride, agent)
        if override is None:
            override = AgentOverride(agent_id=agent, fleet=fleet, model_name=record.name)
            session.add(override)
        override.fleet = fleet
        override.model_name = record.name
        override.version = record.version
        override.kind = kind
        override.rollout_id = rollout_id
        override.created_at = datetime.now(UTC)
        session.flush()
        raw = signed_announcement(
            session=session, key=key, record=record, fleet=fleet, agent=agent, ttl=ttl
        )
        announcer.announce(topics.agent_models(fleet, agent), raw)


def promote(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    version: str,
    key: FleetSigningKey,
    clear_canaries: bool = True,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> FleetModel:
    """Make ``version`` the fleet's retained announcement; canary overrides are withdrawn."""
    validate_id(fleet, "fleet")
    record = get_version(session=session, name=name, version=version)
    require_servable(record)
    check_agents(session, record, fleet=fleet)
    current = session.get(FleetModel, fleet)
    if current is None:
        current = FleetModel(fleet=fleet, model_name=name, version=version, history=[])
        session.add(current)
    elif current.version != version or current.model_name != name:
        current.history = [*current.history, current.version][-20:]
        current.model_name, current.version = name, version
    current.updated_at = datetime.now(UTC)
    record.state = "serving"
    session.flush()
    raw = signed_announcement(session=session, key=key, record=record, fleet=fleet, ttl=ttl)
    announcer.announce(topics.fleet_models(fleet), raw)
    if clear_canaries:
        clear_overrides(
            session=session, announcer=announcer, topics=topics, fleet=fleet, kind="canary"
        )
    return current


def rollback(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> FleetModel:
    """Announce the version the fleet served before the current one (a newer announcement)."""
    current = session.get(FleetModel, fleet)
    if current is None or current.model_name != name or not current.history:
        raise ConflictError(f"fleet {fleet} has no earlier version of {name} to roll back to")
    previous = current.history[-1]
    record = get_version(session=session, name=name, version=previous)
    require_servable(record)
    current.history = current.history[:-1]
    current.version = previous
    current.updated_at = datetime.now(UTC)
    session.flush()
    raw = signed_announcement(session=session, key=key, record=record, fleet=fleet, ttl=ttl)
    announcer.announce(topics.fleet_models(fleet), raw)
    return current


def pin(
    *,
    session: Session,
    announcer: Announcer,
    topics: Topics,
    fleet: str,
    name: str,
    version: str,
    agents: Sequence[str],
    key: FleetSigningKey,
    ttl: timedelta = DEFAULT_ANNOUNCEMENT_TTL,
) -> None:
    """Hold these agents on ``version`` whatever the fleet is announced."""
    if not agents:
        raise ContractError("name at least one agent to pin")
    record = get_version(session=session, name=name, version=version)
    set_overrides(
        session=session,
        announcer=announcer,
        topics=topics,
        fleet=fleet,
        record=record,
        agents=agents,
        kind="pin",
        key=key,
        ttl=ttl,
    )


def unpin(
    *, session: Session, announcer: Announcer, topics: Topics, fleet: str, agents: Sequence[str]
) -> list[str]:
    return clear_overrides(
        session=session, announcer=announcer, topics=topics, fleet=fleet, agents=agents, kind="pin"
    )
