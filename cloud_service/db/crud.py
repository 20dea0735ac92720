"""Plain functions over a Session, keyword-only; routes and workers call these, nothing else.

Writes that must be idempotent (samples, verdicts) use the dialect's
``INSERT ... ON CONFLICT DO NOTHING`` with RETURNING, so one statement both stores
a batch and tells which rows were new.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from cloud_service.db.models import (
    USER_ROLES,
    Agent,
    Base,
    DeadLetter,
    EnrollmentToken,
    Label,
    ModelStatusEvent,
    Sample,
    User,
    Verdict,
)
from cloud_service.errors import AuthError, ConflictError, NotFoundError
from cloud_service.passwords import MIN_PASSWORD_LENGTH, hash_password, verify_password
from shared.errors import ContractError, StoreError
from shared.messages import AgentStatus, ModelStatus

__all__ = [
    "add_label",
    "agent_for_api_token",
    "authenticate_user",
    "colliding_sample_id",
    "create_enrollment_token",
    "create_user",
    "enroll_agent",
    "get_sample",
    "get_user",
    "get_verdicts",
    "hash_token",
    "insert_dead_letters",
    "insert_samples",
    "insert_verdicts",
    "list_agents",
    "list_dead_letters",
    "list_samples",
    "list_users",
    "list_verdicts",
    "pending_samples",
    "record_agent_status",
    "record_model_status",
    "set_password",
    "stats",
    "store_samples",
]


def hash_token(token: str) -> str:
    """sha256 of a bearer token (tokens are random and long, so no salt is needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _insert_ignore(session: Session, model: type[Base], key: str) -> Any:
    """An INSERT that skips rows whose ``key`` already exists, for this session's dialect."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(model).on_conflict_do_nothing(index_elements=[key])
    if dialect == "sqlite":
        return sqlite.insert(model).on_conflict_do_nothing(index_elements=[key])
    raise StoreError(f"database {dialect!r} is not supported: use SQLite or PostgreSQL")


def _chunks(rows: Sequence[dict[str, Any]], size: int = 500) -> Iterable[Sequence[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


# --- ingest ------------------------------------------------------------------


def _insert_ignore_unnest(
    session: Session, model: type[Base], key: str, rows: Sequence[dict[str, Any]]
) -> set[str]:
    """PostgreSQL: ``INSERT ... SELECT unnest(array), ... ON CONFLICT DO NOTHING RETURNING``.

    One statement of one array parameter per column, whatever the number of rows: its
    text never changes (psycopg parses it once, not once per batch as it must a
    multi-row VALUES list), and psycopg adapts each column's values as one array.
    """
    table = model.__table__
    dialect = session.get_bind().dialect
    columns: list[Any] = []
    defaults: dict[str, Any] = {}
    for column in table.columns:
        if column.name in rows[0]:
            columns.append(column)
        elif column.default is not None and not column.primary_key:
            # A Python-side default the ORM would have applied (received_at, status, ...):
            # computed once for the batch.
            default = column.default
            defaults[column.name] = default.arg(None) if default.is_callable else default.arg
            columns.append(column)
    selects: list[str] = []
    params: dict[str, list[Any]] = {}
    for column in columns:
        if column.name in defaults:
            values = [defaults[column.name]] * len(rows)
        else:
            values = [row[column.name] for row in rows]
        kind = column.type.compile(dialect=dialect)
        if kind in ("JSON", "JSONB"):
            values = [None if v is None else json.dumps(v) for v in values]
            selects.append(f"CAST(unnest(CAST(:{column.name} AS TEXT[])) AS {kind})")
        else:
            selects.append(f"unnest(CAST(:{column.name} AS {kind}[]))")
        params[column.name] = values
    names = ", ".join(c.name for c in columns)
    statement = text(
        f"INSERT INTO {model.__tablename__} ({names}) SELECT {', '.join(selects)}"
        f" ON CONFLICT ({key}) DO NOTHING RETURNING {key}"
    )
    return set(session.scalars(statement, params).all())


def insert_samples(*, session: Session, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Store sample rows, skipping ids already stored; return the ids that were new."""
    new: set[str] = set()
    if rows and session.get_bind().dialect.name == "postgresql":
        return _insert_ignore_unnest(session, Sample, "sample_id", rows)
    for chunk in _chunks(rows):
        stmt = _insert_ignore(session, Sample, "sample_id").returning(Sample.sample_id)
        new.update(session.scalars(stmt, list(chunk)).all())
    return new


# Ids of samples stored under a cloud id because another agent's sample holds theirs.
_COLLISION_NAMESPACE = uuid.UUID("6f1c2a52-3e0b-5d8e-9a41-0c7b2d1e5f63")


def colliding_sample_id(fleet: str, agent: str, sample_id: str, attempt: int) -> str:
    """The cloud id of ``sample_id`` from ``fleet/agent`` after ``attempt`` collisions.

    Deterministic, so a redelivery finds the row its first delivery made.
    """
    return str(uuid.uuid5(_COLLISION_NAMESPACE, f"{fleet}/{agent}/{sample_id}/{attempt}"))


# Cloud ids tried for a sample whose id other agents' samples hold, before giving up.
COLLISION_ATTEMPTS = 4

SampleKey = tuple[str, str, str]  # (fleet, agent, the agent's sample id)


def store_samples(
    *, session: Session, rows: Sequence[dict[str, Any]]
) -> dict[SampleKey, tuple[str, bool]]:
    """Store sample rows, unique per agent; return each one's (cloud id, whether new).

    A row is stored under the agent's own id (``edge_sample_id``) unless another
    agent's sample holds that id; then under ``colliding_sample_id``, a cloud id
    derived from (fleet, agent, id), so a redelivery finds the same row. A row
    missing from the result could not be given an id (every candidate was held).
    """

    def key(row: dict[str, Any]) -> SampleKey:
        return (row["fleet"], row["agent_id"], row["edge_sample_id"])

    pending: dict[SampleKey, dict[str, Any]] = {}
    for row in rows:
        pending.setdefault(key(row), {**row, "sample_id": row["edge_sample_id"]})
    out: dict[SampleKey, tuple[str, bool]] = {}
    for attempt in range(1, COLLISION_ATTEMPTS + 2):
        if not pending:
            break
        batch = list(pending.values())
        new = insert_samples(session=session, rows=batch)
        claims: dict[str, int] = {}
        for row in batch:
            claims[row["sample_id"]] = claims.get(row["sample_id"], 0) + 1
        unsure: list[dict[str, Any]] = []
        for row in batch:
            if row["sample_id"] in new and claims[row["sample_id"]] == 1:
                out[key(row)] = (row["sample_id"], True)
                del pending[key(row)]
            else:
                unsure.append(row)
        if not unsure:
            break
        # Who holds each id now: this row's own earlier delivery, or another agent's sample.
        holders = {
            sample_id: (fleet, agent, edge_id or sample_id)
            for sample_id, fleet, agent, edge_id in session.execute(
                select(
                    Sample.sample_id, Sample.fleet, Sample.agent_id, Sample.edge_sample_id
                ).where(Sample.sample_id.in_({row["sample_id"] for row in unsure}))
            )
        }
        for row in unsure:
            holder = holders.get(row["sample_id"])
            if holder == key(row):
                out[key(row)] = (row["sample_id"], row["sample_id"] in new)
                del pending[key(row)]
            elif holder is not None:
                row["sample_id"] = colliding_sample_id(*key(row), attempt)
    return out


def insert_dead_letters(*, session: Session, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        session.execute(insert(DeadLetter), list(rows))


def record_agent_status(*, session: Session, status: AgentStatus) -> None:
    """Upsert the agent row from its status (heartbeat or last will)."""
    telemetry = status.model_dump(
        mode="json", exclude={"schema_name", "v", "fleet", "agent", "state"}, exclude_none=True
    )
    agent = session.get(Agent, status.agent)
    if agent is None:
        agent = Agent(agent_id=status.agent, fleet=status.fleet, telemetry={})
        session.add(agent)
    elif agent.last_seen_at is not None and agent.last_seen_at > status.sent_at:
        return  # an older status delivered late must not overwrite a newer one
    agent.fleet = status.fleet
    agent.state = status.state
    agent.last_seen_at = status.sent_at
    agent.telemetry = telemetry
    if status.model_version is not None:
        agent.model_version = status.model_version


def record_model_status(*, session: Session, status: ModelStatus) -> None:
    agent = session.get(Agent, status.agent)
    if agent is None:
        agent = Agent(agent_id=status.agent, fleet=status.fleet, telemetry={}, state="unknown")
        session.add(agent)
    agent.model_status = status.model_dump(mode="json", exclude={"schema_name", "v"})
    # The history feeds rollout evaluation (refusals count as errors) and the registry API.
    session.add(
        ModelStatusEvent(
            fleet=status.fleet,
            agent_id=status.agent,
            model_name=status.model_name,
            model_version=status.model_version,
            state=status.state,
            reason=status.reason,
            at=status.at,
        )
    )
    if status.state in ("active", "rolled-back"):
        agent.model_version = status.model_version


def pending_samples(
    *,
    session: Session,
    limit: int = 1000,
    after: str = "",
    received_before: datetime | None = None,
) -> list[Sample]:
    """Stored samples still waiting for a verdict, in id (capture time) order.

    ``received_before`` leaves out samples stored since then: with several verifiers,
    a recent pending sample is most likely in another verifier's batch right now.
    """
    stmt = select(Sample).where(Sample.status == "pending", Sample.sample_id > after)
    if received_before is not None:
        stmt = stmt.where(Sample.received_at < received_before)
    stmt = stmt.order_by(Sample.sample_id).limit(limit)
    return list(session.scalars(stmt).all())


def insert_verdicts(*, session: Session, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Store verdicts (one per sample at most) and move their samples on; return new ids."""
    new: set[str] = set()
    if rows and session.get_bind().dialect.name == "postgresql":
        new = _insert_ignore_unnest(session, Verdict, "sample_id", rows)
    else:
        for chunk in _chunks(rows):
            stmt = _insert_ignore(session, Verdict, "sample_id").returning(Verdict.sample_id)
            new.update(session.scalars(stmt, list(chunk)).all())
    by_status: dict[tuple[str, datetime], list[str]] = {}
    for row in rows:
        if row["sample_id"] in new:
            status = "flagged" if row["review"] else "verified"
            by_status.setdefault((status, row["verified_at"]), []).append(row["sample_id"])
    for (status, verified_at), ids in by_status.items():
        session.execute(
            update(Sample)
            .where(Sample.sample_id.in_(ids), Sample.status == "pending")
            .values(status=status, verified_at=verified_at)
        )
    return new


def get_verdicts(*, session: Session, sample_ids: Sequence[str]) -> list[Verdict]:
    if not sample_ids:
        return []
    return list(session.scalars(select(Verdict).where(Verdict.sample_id.in_(sample_ids))).all())


# --- enrollment --------------------------------------------------------------


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


# --- reading -----------------------------------------------------------------


def list_agents(
    *,
    session: Session,
    fleet: str | None = None,
    agent_id: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[Agent], int]:
    stmt = select(Agent)
    if agent_id is not None:
        stmt = stmt.where(Agent.agent_id == agent_id)
    if fleet is not None:
        stmt = stmt.where(Agent.fleet == fleet)
    return _page(session, stmt.order_by(Agent.agent_id), limit, offset)


def _page(session: Session, stmt: Select[Any], limit: int, offset: int) -> tuple[list[Any], int]:
    total = session.scalar(select(func.count()).select_from(stmt.order_by(None).subquery())) or 0
    items = list(session.scalars(stmt.limit(limit).offset(offset)).all())
    return items, int(total)


def list_samples(
    *,
    session: Session,
    fleet: str | None = None,
    agent_id: str | None = None,
    status: str | None = None,
    route_reason: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Sample], int]:
    stmt = select(Sample)
    if fleet is not None:
        stmt = stmt.where(Sample.fleet == fleet)
    if agent_id is not None:
        stmt = stmt.where(Sample.agent_id == agent_id)
    if status is not None:
        stmt = stmt.where(Sample.status == status)
    if route_reason is not None:
        stmt = stmt.where(Sample.route_reason == route_reason)
    if since is not None:
        stmt = stmt.where(Sample.captured_at >= since)
    if until is not None:
        stmt = stmt.where(Sample.captured_at < until)
    return _page(session, stmt.order_by(Sample.sample_id.desc()), limit, offset)


def get_sample(*, session: Session, sample_id: str) -> tuple[Sample, Verdict | None, list[Label]]:
    sample = session.get(Sample, sample_id)
    if sample is None:
        raise NotFoundError(f"sample {sample_id} is not stored")
    verdict = session.scalars(select(Verdict).where(Verdict.sample_id == sample_id)).first()
    labels = list(
        session.scalars(select(Label).where(Label.sample_id == sample_id).order_by(Label.id)).all()
    )
    return sample, verdict, labels


def list_verdicts(
    *,
    session: Session,
    agent_id: str | None = None,
    review: bool | None = None,
    agrees: bool | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Verdict], int]:
    stmt = select(Verdict)
    if agent_id is not None:
        stmt = stmt.join(Sample, Sample.sample_id == Verdict.sample_id).where(
            Sample.agent_id == agent_id
        )
    if review is not None:
        stmt = stmt.where(Verdict.review == review)
    if agrees is not None:
        stmt = stmt.where(Verdict.agrees_with_edge == agrees)
    return _page(session, stmt.order_by(Verdict.id.desc()), limit, offset)


def list_dead_letters(
    *, session: Session, reason: str | None = None, limit: int = 50, offset: int = 0
) -> tuple[list[DeadLetter], int]:
    stmt = select(DeadLetter)
    if reason is not None:
        stmt = stmt.where(DeadLetter.reason == reason)
    return _page(session, stmt.order_by(DeadLetter.id.desc()), limit, offset)


def add_label(
    *,
    session: Session,
    sample_id: str,
    label: int,
    labeled_by: str,
    note: str | None = None,
    classes: int | None = None,
) -> Label:
    """Record a human label; the sample becomes "reviewed"."""
    sample = session.get(Sample, sample_id)
    if sample is None:
        raise NotFoundError(f"sample {sample_id} is not stored")
    n = classes if classes is not None else len(sample.edge_scores)
    if not 0 <= label < n:
        raise ContractError(
            f"label {label} is not a class of this sample: use 0..{n - 1}", reason="invalid_label"
        )
    record = Label(sample_id=sample_id, label=label, labeled_by=labeled_by, note=note)
    session.add(record)
    sample.status = "reviewed"
    return record


def stats(*, session: Session) -> dict[str, Any]:
    """Counts for the dashboard: samples by status, verdict agreement, dead letters by reason."""
    by_status = dict(
        session.execute(select(Sample.status, func.count()).group_by(Sample.status)).all()
    )
    verdicts = session.scalar(select(func.count()).select_from(Verdict)) or 0
    agreed = (
        session.scalar(
            select(func.count()).select_from(Verdict).where(Verdict.agrees_with_edge.is_(True))
        )
        or 0
    )
    flagged = (
        session.scalar(select(func.count()).select_from(Verdict).where(Verdict.review.is_(True)))
        or 0
    )
    dead = dict(
        session.execute(select(DeadLetter.reason, func.count()).group_by(DeadLetter.reason)).all()
    )
    agents = session.scalar(select(func.count()).select_from(Agent)) or 0
    online = (
        session.scalar(select(func.count()).select_from(Agent).where(Agent.state == "online")) or 0
    )
    return {
        "samples": {str(k): int(v) for k, v in by_status.items()},
        "samples_total": int(sum(by_status.values())),
        "verdicts": int(verdicts),
        "agreement_rate": (agreed / verdicts) if verdicts else None,
        "review_rate": (flagged / verdicts) if verdicts else None,
        "labels": int(session.scalar(select(func.count()).select_from(Label)) or 0),
        "dead_letters": {str(k): int(v) for k, v in dead.items()},
        "agents": int(agents),
        "agents_online": int(online),
    }


# --- review UI users ---------------------------------------------------------

_USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


def _check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ContractError(
            f"a password needs at least {MIN_PASSWORD_LENGTH} characters", reason="weak_password"
        )


def create_user(*, session: Session, username: str, password: str, role: str) -> User:
    """Add a review UI user; the username is unique, the role "admin" or "reviewer"."""
    if not _USERNAME.match(username):
        raise ContractError(
            f"username {username!r} is not valid: letters, digits and _.@- (at most 64)",
            reason="invalid_username",
        )
    if role not in USER_ROLES:
        raise ContractError(
            f"role {role!r} is not one of {list(USER_ROLES)}", reason="invalid_role"
        )
    _check_password(password)
    if session.scalars(select(User).where(User.username == username)).first() is not None:
        raise ConflictError(f"user {username} already exists")
    user = User(
        username=username,
        password_hash=hash_password(password),
        role=role,
        disabled=False,
        session_generation=0,
    )
    session.add(user)
    session.flush()
    return user


def set_password(*, session: Session, username: str, password: str) -> User:
    """Change a user's password; sessions signed before the change stop working."""
    user = session.scalars(select(User).where(User.username == username)).first()
    if user is None:
        raise NotFoundError(f"user {username} does not exist")
    _check_password(password)
    user.password_hash = hash_password(password)
    user.session_generation += 1
    return user


def list_users(*, session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.username)).all())


def get_user(*, session: Session, user_id: int) -> User | None:
    return session.get(User, user_id)


def authenticate_user(*, session: Session, username: str, password: str) -> User | None:
    """The enabled user with this username and password, else None."""
    user = session.scalars(select(User).where(User.username == username)).first()
    if user is None:
        hash_password(password)  # spend the same time, so timing does not reveal names
        return None
    if user.disabled or not verify_password(password, user.password_hash):
        return None
    user.last_login_at = datetime.now(UTC)
    return user
