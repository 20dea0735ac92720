"""Reading what the cloud stores (agents, samples, verdicts, dead letters), labels, and counts."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, DeadLetter, Label, Sample, Verdict
from cloud_service.errors import NotFoundError
from shared.errors import ContractError

__all__ = [
    "add_label",
    "get_sample",
    "list_agents",
    "list_dead_letters",
    "list_samples",
    "list_verdicts",
    "stats",
]


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
