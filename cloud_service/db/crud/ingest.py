"""What ingest and the verifier write: samples, verdicts, dead letters, agent and model status.

Writes that must be idempotent (samples, verdicts) use the dialect's
``INSERT ... ON CONFLICT DO NOTHING`` with RETURNING, so one statement both stores
a batch and tells which rows were new.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from types import NoneType
from typing import Any

import orjson
from sqlalchemy import insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, Base, DeadLetter, ModelStatusEvent, Sample, Verdict
from shared.errors import StoreError
from shared.messages import AgentStatus, ModelStatus

__all__ = [
    "COLLISION_ATTEMPTS",
    "SampleKey",
    "colliding_sample_id",
    "get_verdicts",
    "image_keys_under",
    "insert_dead_letters",
    "insert_samples",
    "insert_verdicts",
    "pending_samples",
    "record_agent_status",
    "record_model_status",
    "store_samples",
]


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


@functools.lru_cache(maxsize=64)
def _unnest_insert_sql(
    table: Any, dialect: Any, names: tuple[str, ...]
) -> tuple[str, tuple[tuple[str, bool], ...], tuple[tuple[str, Any], ...]]:
    """``INSERT INTO t (...) SELECT unnest(...), ...`` for rows holding ``names``: the SQL,
    each column's (name, whether JSON), and the Python-side defaults of the columns the
    rows leave out (computed per batch). Built once per table and set of names."""
    columns: list[tuple[str, bool]] = []
    defaults: list[tuple[str, Any]] = []
    selects: list[str] = []
    for column in table.columns:
        if column.name not in names:
            if column.default is None or column.primary_key:
                continue
            # A Python-side default the ORM would have applied (received_at, status, ...).
            defaults.append((column.name, column.default))
        kind = column.type.compile(dialect=dialect)
        json_ = kind in ("JSON", "JSONB")
        if json_:
            selects.append(f"CAST(unnest(CAST(:{column.name} AS TEXT[])) AS {kind})")
        else:
            selects.append(f"unnest(CAST(:{column.name} AS {kind}[]))")
        columns.append((column.name, json_))
    sql = (
        f"INSERT INTO {table.name} ({', '.join(name for name, _ in columns)})"
        f" SELECT {', '.join(selects)}"
    )
    return sql, tuple(columns), tuple(defaults)


# What json.dumps took as well: numpy numbers (float64 is a float) and int keys.
_JSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _array_literal(values: list[Any]) -> str | list[Any]:
    """PostgreSQL's text form of an array of ``values`` (``{"a",NULL,1.5,t}``), or the
    list itself when a value is of a type not written here (psycopg adapts it then).

    psycopg adapts a list element by element in Python, about 10 us per row of a
    dozen columns; one string per column, written here, costs a fraction of that.
    Every text and timestamp is quoted, with backslashes and quotes escaped, so no
    value can end its element early or read as NULL. A column of one type and no
    NULL (most of them) is joined in one pass.
    """
    kinds = set(map(type, values))
    if not kinds <= _WRITTEN:
        return values
    if len(kinds) != 1 or NoneType in kinds:
        return _mixed_array_literal(values)
    kind = kinds.pop()
    if kind is str:
        body = '","'.join(values)
        # Each separator holds two quotes: any more are the values' own.
        if "\\" in body or body.count('"') != 2 * (len(values) - 1):
            body = '","'.join(_escaped(value) for value in values)
        return '{"' + body + '"}'
    if kind is float:
        body = ",".join(map(repr, values))
        if "n" in body:  # nan, inf or -inf among them
            body = ",".join(_NON_FINITE.get(text, text) for text in map(repr, values))
        return "{" + body + "}"
    if kind is int:
        return "{" + ",".join(map(str, values)) + "}"
    if kind is bool:
        return "{" + ",".join("t" if value else "f" for value in values) + "}"
    # datetime: a batch's rows often share one (received_at, verified_at), written once.
    if values.count(values[0]) == len(values):
        return '{"' + '","'.join([values[0].isoformat()] * len(values)) + '"}'
    return '{"' + '","'.join(value.isoformat() for value in values) + '"}'


_WRITTEN = frozenset({str, float, int, bool, datetime, NoneType})


def _escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _mixed_array_literal(values: list[Any]) -> str:
    """``_array_literal`` of values of the written types, NULLs or several types among them."""
    parts: list[str] = []
    add = parts.append
    for value in values:
        kind = type(value)
        if kind is str:
            add('"' + _escaped(value) + '"')
        elif value is None:
            add("NULL")
        elif kind is float:
            text = repr(value)
            add(_NON_FINITE.get(text, text))
        elif kind is bool:
            add("t" if value else "f")
        elif kind is int:
            add(str(value))
        else:  # datetime
            add('"' + value.isoformat() + '"')
    return "{" + ",".join(parts) + "}"


def _unnest_insert(
    session: Session, model: type[Base], rows: Sequence[dict[str, Any]]
) -> tuple[str, dict[str, str | list[Any]]]:
    """PostgreSQL: ``INSERT ... SELECT unnest(array), ...`` of ``rows`` and its parameters.

    One array parameter per column, whatever the number of rows: the statement's
    text never changes (psycopg prepares it once, not once per batch as it must a
    multi-row VALUES list), and psycopg adapts each column's values as one array.
    """
    sql, columns, defaults = _unnest_insert_sql(
        model.__table__, session.get_bind().dialect, tuple(sorted(rows[0]))
    )
    fixed = {
        name: default.arg(None) if default.is_callable else default.arg
        for name, default in defaults
    }
    params: dict[str, str | list[Any]] = {}
    for name, json_ in columns:
        if name in fixed:
            params[name] = _array_literal([fixed[name]] * len(rows))
        elif json_:
            # orjson: a few times faster than json on these small lists, per cell.
            params[name] = _array_literal(
                [
                    None if (v := row[name]) is None else orjson.dumps(v, option=_JSON).decode()
                    for row in rows
                ]
            )
        else:
            params[name] = _array_literal([row[name] for row in rows])
    return sql, params


def _insert_ignore_unnest(
    session: Session, model: type[Base], key: str, rows: Sequence[dict[str, Any]]
) -> set[str]:
    """PostgreSQL: ``rows`` inserted by ``_unnest_insert``, skipping ``key``s already
    stored (ON CONFLICT DO NOTHING); the keys that were new."""
    sql, params = _unnest_insert(session, model, rows)
    statement = _text(f"{sql} ON CONFLICT ({key}) DO NOTHING RETURNING {key}")
    return set(session.scalars(statement, params).all())


@functools.lru_cache(maxsize=64)
def _text(sql: str) -> Any:
    """A TextClause per SQL string, made once (parsing its bind names costs per call)."""
    return text(sql)


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
    Of several rows with one key, the first is the one stored (ingest deletes the
    images of the others).
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


def image_keys_under(*, session: Session, prefix: str) -> list[str]:
    """The image keys of samples that start with ``prefix`` (a blob pack's members).

    No index covers it (each insert would pay for one): it scans, and only the sweep
    of packs a dead verifier left unsettled asks it, a pack or two per crash.
    """
    stmt = select(Sample.image_key).where(Sample.image_key.startswith(prefix, autoescape=True))
    return list(session.scalars(stmt).all())


def insert_verdicts(*, session: Session, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Store verdicts (one per sample at most) and move their samples on; return new ids."""
    if rows and session.get_bind().dialect.name == "postgresql":
        # One statement, one round trip: the insert, and the update of the samples that
        # got a new verdict, as data-modifying CTEs.
        sql, params = _unnest_insert(session, Verdict, rows)
        statement = _text(
            f"WITH new AS ({sql} ON CONFLICT (sample_id) DO NOTHING"
            " RETURNING sample_id, review, verified_at),"
            " moved AS (UPDATE samples SET verified_at = new.verified_at, status ="
            " CASE WHEN new.review THEN 'flagged' ELSE 'verified' END FROM new"
            " WHERE samples.sample_id = new.sample_id AND samples.status = 'pending')"
            " SELECT sample_id FROM new"
        )
        return set(session.scalars(statement, params).all())
    new: set[str] = set()
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
