"""What the review UI reads and writes: the queue, reviews with undo, export rows, charts.

Keyword-only functions over a Session, like ``cloud_service.db.crud``; the UI's
routes call these and nothing else touches the database for them.

Reviews are optimistic: the page carries the sample's *review token* (its status
and the id of its newest label, ``"flagged:0"``); a write whose token no longer
matches is refused with ConflictError (409) instead of overwriting what another
reviewer did meanwhile. The status check is a conditional UPDATE, so two reviewers
racing on PostgreSQL cannot both win.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import Integer, and_, cast, delete, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from cloud_service.db.models import Label, ModelVersion, Sample, Verdict
from cloud_service.errors import ConflictError, NotFoundError
from shared.errors import ContractError

__all__ = [
    "QueueFilter",
    "ReviewResult",
    "bulk_review",
    "class_names",
    "dashboard_series",
    "export_rows",
    "neighbour",
    "queue_page",
    "review_sample",
    "review_token",
    "sample_view",
    "undo_review",
]

SORTS: dict[str, tuple[str, bool]] = {
    # name: (column, descending); sample_id breaks ties in the same direction.
    "newest": ("captured_at", True),
    "oldest": ("captured_at", False),
    "confidence": ("edge_confidence", False),
    "-confidence": ("edge_confidence", True),
}
STATUSES = ("flagged", "verified", "reviewed", "discarded", "pending", "any")
ROUTE_REASONS = ("low_confidence", "margin", "entropy", "class_threshold", "audit", "manual")
PAGE_SIZES = (25, 50, 100, 200)


def _parse_day(text: str, *, end: bool) -> datetime | None:
    """A date (``2026-01-31``) or ISO time; a date's end is the next midnight."""
    if not text:
        return None
    try:
        if len(text) == 10:
            day = date.fromisoformat(text)
            moment = datetime.combine(day, time(), UTC)
            return moment + timedelta(days=1) if end else moment
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ContractError(
            f"{text!r} is not a date (YYYY-MM-DD) or an ISO time", reason="invalid_filter"
        ) from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _int_or_none(text: str, name: str) -> int | None:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise ContractError(f"{name} must be a whole number", reason="invalid_filter") from exc


def _float_or_none(text: str, name: str) -> float | None:
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError as exc:
        raise ContractError(f"{name} must be a number in 0..1", reason="invalid_filter") from exc
    if not 0.0 <= value <= 1.0:
        raise ContractError(f"{name} must be a number in 0..1", reason="invalid_filter")
    return value


@dataclass(frozen=True)
class QueueFilter:
    """The queue's filter, sort and page; it round-trips through the URL's query string."""

    status: str = "flagged"
    agent: str = ""
    fleet: str = ""
    edge_class: str = ""
    teacher_class: str = ""
    model_version: str = ""
    reason: str = ""
    since: str = ""
    until: str = ""
    conf_min: str = ""
    conf_max: str = ""
    sort: str = "newest"
    page: int = 1
    per_page: int = 50

    @classmethod
    def from_query(cls, query: Any) -> QueueFilter:
        """From a query-string mapping; unknown keys are ignored, bad values refused."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = query.get(f.name)
            if raw is None:
                continue
            raw = str(raw).strip()[:64]
            if f.name in ("page", "per_page"):
                number = _int_or_none(raw, f.name)
                if number is not None:
                    values[f.name] = number
            else:
                values[f.name] = raw
        result = cls(**values)
        result.check()
        return result

    def check(self) -> None:
        if self.status not in STATUSES:
            raise ContractError(
                f"status {self.status!r} is not one of {list(STATUSES)}", reason="invalid_filter"
            )
        if self.sort not in SORTS:
            raise ContractError(
                f"sort {self.sort!r} is not one of {list(SORTS)}", reason="invalid_filter"
            )
        if self.reason and self.reason not in ROUTE_REASONS:
            raise ContractError(
                f"reason {self.reason!r} is not one of {list(ROUTE_REASONS)}",
                reason="invalid_filter",
            )
        if self.page < 1 or self.page > 100_000:
            raise ContractError("page must be 1..100000", reason="invalid_filter")
        if self.per_page not in PAGE_SIZES:
            raise ContractError(f"per_page must be one of {PAGE_SIZES}", reason="invalid_filter")
        _int_or_none(self.edge_class, "edge_class")
        _int_or_none(self.teacher_class, "teacher_class")
        _float_or_none(self.conf_min, "conf_min")
        _float_or_none(self.conf_max, "conf_max")
        _parse_day(self.since, end=False)
        _parse_day(self.until, end=True)

    def query_string(self, **changes: Any) -> str:
        """This filter as a query string (defaults left out), with ``changes`` applied."""
        target = replace(self, **changes)
        default = QueueFilter()
        pairs = [
            (f.name, getattr(target, f.name))
            for f in fields(self)
            if getattr(target, f.name) != getattr(default, f.name)
        ]
        return urlencode(pairs)

    def without_page(self) -> QueueFilter:
        return replace(self, page=1)

    def conditions(self) -> list[Any]:
        """The WHERE terms on samples (and verdicts, for the teacher class)."""
        terms: list[Any] = []
        if self.status != "any":
            terms.append(Sample.status == self.status)
        if self.agent:
            terms.append(Sample.agent_id == self.agent)
        if self.fleet:
            terms.append(Sample.fleet == self.fleet)
        if (edge := _int_or_none(self.edge_class, "edge_class")) is not None:
            terms.append(Sample.edge_predicted == edge)
        if (teacher := _int_or_none(self.teacher_class, "teacher_class")) is not None:
            terms.append(Verdict.label == teacher)
        if self.model_version:
            terms.append(Sample.model_version == self.model_version)
        if self.reason:
            terms.append(Sample.route_reason == self.reason)
        if (since := _parse_day(self.since, end=False)) is not None:
            terms.append(Sample.captured_at >= since)
        if (until := _parse_day(self.until, end=True)) is not None:
            terms.append(Sample.captured_at < until)
        if (low := _float_or_none(self.conf_min, "conf_min")) is not None:
            terms.append(Sample.edge_confidence >= low)
        if (high := _float_or_none(self.conf_max, "conf_max")) is not None:
            terms.append(Sample.edge_confidence <= high)
        return terms

    def order_by(self) -> list[Any]:
        column, descending = SORTS[self.sort]
        key = getattr(Sample, column)
        if descending:
            return [key.desc(), Sample.sample_id.desc()]
        return [key.asc(), Sample.sample_id.asc()]


def _joined(flt: QueueFilter) -> Any:
    return (
        select(Sample, Verdict)
        .outerjoin(Verdict, Verdict.sample_id == Sample.sample_id)
        .where(*flt.conditions())
    )


@dataclass
class QueuePage:
    rows: list[tuple[Sample, Verdict | None]]
    total: int
    pages: int


def queue_page(*, session: Session, flt: QueueFilter) -> QueuePage:
    """One page of the queue (newest first by default) and the filter's total count."""
    count = select(func.count()).select_from(Sample)
    if flt.teacher_class:
        count = count.join(Verdict, Verdict.sample_id == Sample.sample_id)
    total = int(session.scalar(count.where(*flt.conditions())) or 0)
    stmt = (
        _joined(flt)
        .order_by(*flt.order_by())
        .limit(flt.per_page)
        .offset((flt.page - 1) * flt.per_page)
    )
    rows = [(s, v) for s, v in session.execute(stmt).all()]
    return QueuePage(rows=rows, total=total, pages=max(1, -(-total // flt.per_page)))


def neighbour(
    *, session: Session, flt: QueueFilter, sample: Sample, forward: bool = True
) -> tuple[Sample, Verdict | None] | None:
    """The sample after (or before) ``sample`` in the filter's order (keyset, no offset).

    ``sample`` itself need not match the filter any more (it was just reviewed).
    """
    column, descending = SORTS[flt.sort]
    key = getattr(Sample, column)
    here = tuple_(key, Sample.sample_id)
    there = tuple_(getattr(sample, column), sample.sample_id)
    # Forward in a descending order means smaller keys; backward flips both.
    smaller = descending == forward
    after = here < there if smaller else here > there
    order = (
        [key.desc(), Sample.sample_id.desc()] if smaller else [key.asc(), Sample.sample_id.asc()]
    )
    row = session.execute(_joined(flt).where(after).order_by(*order).limit(1)).first()
    return (row[0], row[1]) if row else None


def review_token(*, session: Session, sample: Sample) -> str:
    """The sample's current review state: status and newest label id."""
    newest = session.scalar(select(func.max(Label.id)).where(Label.sample_id == sample.sample_id))
    return f"{sample.status}:{newest or 0}"


_CLASS_CACHE: dict[tuple[str, str], list[str] | None] = {}
_CLASS_LOCK = threading.Lock()


def class_names(*, session: Session, model_name: str, model_version: str, n: int) -> list[str]:
    """Class labels from the registered model's manifest, else "0".."n-1"."""
    key = (model_name, model_version)
    with _CLASS_LOCK:
        cached = _CLASS_CACHE.get(key, ...)
    if cached is ...:
        record = session.scalars(
            select(ModelVersion.manifest).where(
                ModelVersion.name == model_name, ModelVersion.version == model_version
            )
        ).first()
        labels = record.get("labels") if isinstance(record, dict) else None
        cached = [str(x) for x in labels] if isinstance(labels, list) else None
        with _CLASS_LOCK:
            _CLASS_CACHE[key] = cached
    if isinstance(cached, list) and len(cached) == n:
        return cached
    return [str(i) for i in range(n)]


def sample_view(
    *, session: Session, sample: Sample, verdict: Verdict | None, with_labels: bool = True
) -> dict[str, Any]:
    """A sample as the review page's JavaScript draws it (JSON-safe)."""
    n = len(sample.edge_scores)
    labels: list[dict[str, Any]] = []
    if with_labels:
        labels = [
            {"label": label.label, "by": label.labeled_by, "at": label.created_at.isoformat()}
            for label in session.scalars(
                select(Label).where(Label.sample_id == sample.sample_id).order_by(Label.id)
            )
        ]
    return {
        "sample_id": sample.sample_id,
        "agent_id": sample.agent_id,
        "fleet": sample.fleet,
        "captured_at": sample.captured_at.isoformat(timespec="seconds"),
        "model_version": sample.model_version,
        "route_reason": sample.route_reason,
        "status": sample.status,
        "classes": class_names(
            session=session, model_name=sample.model_name, model_version=sample.model_version, n=n
        ),
        "edge_scores": [float(x) for x in sample.edge_scores],
        "edge_label": sample.edge_predicted,
        "edge_confidence": sample.edge_confidence,
        "teacher_scores": [float(x) for x in verdict.scores] if verdict else None,
        "teacher_label": verdict.label if verdict else None,
        "teacher_confidence": verdict.confidence if verdict else None,
        "review_reasons": list(verdict.review_reasons) if verdict else [],
        "labels": labels,
        "token": review_token(session=session, sample=sample),
        "image_url": f"/ui/samples/{sample.sample_id}/image",
    }


@dataclass(frozen=True)
class ReviewResult:
    """What a review did, and how to undo it."""

    sample_id: str
    action: str
    label: int | None
    previous_status: str
    label_id: int | None
    token: str
    undo: dict[str, Any] = field(default_factory=dict)


def _set_status(session: Session, sample_id: str, expected: str, new: str) -> bool:
    result = session.execute(
        update(Sample)
        .where(Sample.sample_id == sample_id, Sample.status == expected)
        .values(status=new)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def review_sample(
    *,
    session: Session,
    sample_id: str,
    action: str,
    label: int | None,
    token: str,
    reviewer: str,
) -> ReviewResult:
    """Confirm or relabel (``action="label"``) or discard a sample, if ``token`` still holds."""
    sample = session.get(Sample, sample_id)
    if sample is None:
        raise NotFoundError(f"sample {sample_id} is not stored")
    current = review_token(session=session, sample=sample)
    if token != current:
        raise ConflictError(_conflict_message(session, sample, current))
    previous = sample.status
    if action == "discard":
        new_status, label_id = "discarded", None
    elif action == "label":
        n = len(sample.edge_scores)
        if label is None or not 0 <= label < n:
            raise ContractError(
                f"label {label} is not a class of this sample: use 0..{n - 1}",
                reason="invalid_label",
            )
        new_status = "reviewed"
    else:
        raise ContractError(f"action {action!r} is not label or discard", reason="invalid_action")
    if not _set_status(session, sample_id, previous, new_status):
        session.expire(sample)
        raise ConflictError(_conflict_message(session, sample, None))
    label_id = None
    if action == "label":
        record = Label(sample_id=sample_id, label=int(label or 0), labeled_by=reviewer)
        session.add(record)
        session.flush()
        label_id = record.id
    session.expire(sample)
    new_token = review_token(session=session, sample=sample)
    undo = {"sample_id": sample_id, "previous": previous, "label_id": label_id, "token": new_token}
    return ReviewResult(
        sample_id=sample_id,
        action=action,
        label=label if action == "label" else None,
        previous_status=previous,
        label_id=label_id,
        token=new_token,
        undo=undo,
    )


def _conflict_message(session: Session, sample: Sample, current: str | None) -> str:
    session.refresh(sample)
    newest = session.scalars(
        select(Label).where(Label.sample_id == sample.sample_id).order_by(Label.id.desc())
    ).first()
    who = f" by {newest.labeled_by} (label {newest.label})" if newest else ""
    return (
        f"sample {sample.sample_id} changed meanwhile: it is now {sample.status}{who}; "
        "reload it before reviewing again"
    )


def undo_review(
    *, session: Session, sample_id: str, previous: str, label_id: int | None, token: str, user: str
) -> str:
    """Take back a review: drop its label and restore the status; returns the new token."""
    sample = session.get(Sample, sample_id)
    if sample is None:
        raise NotFoundError(f"sample {sample_id} is not stored")
    if previous not in ("flagged", "verified", "reviewed", "discarded", "pending"):
        raise ContractError(f"status {previous!r} is not a sample status", reason="invalid")
    if review_token(session=session, sample=sample) != token:
        raise ConflictError(_conflict_message(session, sample, None))
    if label_id is not None:
        record = session.get(Label, label_id)
        if record is None or record.sample_id != sample_id or record.labeled_by != user:
            raise ConflictError("that label is not yours to take back")
        session.execute(delete(Label).where(Label.id == label_id))
    if not _set_status(session, sample_id, sample.status, previous):
        raise ConflictError(_conflict_message(session, sample, None))
    session.expire(sample)
    return review_token(session=session, sample=sample)


def bulk_review(
    *,
    session: Session,
    sample_ids: Sequence[str],
    action: str,
    label: int | None,
    reviewer: str,
    expected_status: str = "flagged",
) -> dict[str, Any]:
    """Review many samples; ``confirm`` takes each one's teacher label.

    A sample no longer in ``expected_status`` (someone else reviewed it) is skipped
    and reported, never overwritten.
    """
    if action not in ("confirm", "relabel", "discard"):
        raise ContractError(f"bulk action {action!r} is not confirm, relabel or discard")
    if action == "relabel" and label is None:
        raise ContractError("relabel needs a label", reason="invalid_label")
    done: list[str] = []
    skipped: list[str] = []
    verdicts = {v.sample_id: v for v in _verdicts(session, sample_ids)}
    for sample_id in dict.fromkeys(sample_ids):
        sample = session.get(Sample, sample_id)
        if sample is None or sample.status != expected_status:
            skipped.append(sample_id)
            continue
        chosen: int | None
        if action == "confirm":
            verdict = verdicts.get(sample_id)
            chosen = verdict.label if verdict else sample.edge_predicted
        else:
            chosen = label
        if action != "discard" and not 0 <= int(chosen or 0) < len(sample.edge_scores):
            raise ContractError(f"label {chosen} is not a class of sample {sample_id}")
        new_status = "discarded" if action == "discard" else "reviewed"
        if not _set_status(session, sample_id, expected_status, new_status):
            skipped.append(sample_id)
            continue
        if action != "discard":
            session.add(Label(sample_id=sample_id, label=int(chosen or 0), labeled_by=reviewer))
        done.append(sample_id)
    session.flush()
    return {"done": done, "skipped": skipped}


def _verdicts(session: Session, sample_ids: Iterable[str]) -> list[Verdict]:
    ids = list(sample_ids)
    if not ids:
        return []
    return list(session.scalars(select(Verdict).where(Verdict.sample_id.in_(ids))))


def export_rows(
    *, session: Session, flt: QueueFilter, limit: int = 100_000
) -> list[dict[str, Any]]:
    """Labelled samples under the filter: a human label (newest) beats the teacher's.

    Reviewed samples carry their newest human label; verified ones the teacher's.
    A status filter of "any" or "flagged" exports both kinds; discarded never.
    """
    newest = (
        select(Label.sample_id, func.max(Label.id).label("label_id"))
        .group_by(Label.sample_id)
        .subquery()
    )
    base = replace(flt, status="any")
    stmt = (
        select(Sample, Verdict, Label)
        .outerjoin(Verdict, Verdict.sample_id == Sample.sample_id)
        .outerjoin(newest, newest.c.sample_id == Sample.sample_id)
        .outerjoin(Label, Label.id == newest.c.label_id)
        .where(*base.conditions())
        .where(
            or_(
                and_(Sample.status == "reviewed", Label.id.is_not(None)),
                and_(Sample.status == "verified", Verdict.id.is_not(None)),
            )
        )
        .order_by(*base.order_by())
        .limit(limit)
    )
    if flt.status in ("reviewed", "verified"):
        stmt = stmt.where(Sample.status == flt.status)
    rows = []
    for sample, verdict, label in session.execute(stmt).all():
        n = len(sample.edge_scores)
        names = class_names(
            session=session, model_name=sample.model_name, model_version=sample.model_version, n=n
        )
        chosen = label.label if label is not None else verdict.label
        rows.append(
            {
                "sample_id": sample.sample_id,
                "label": chosen,
                "class_name": names[chosen] if 0 <= chosen < n else str(chosen),
                "source": "human" if label is not None else "teacher",
                "labeled_by": label.labeled_by if label is not None else verdict.teacher_version,
                "agent_id": sample.agent_id,
                "fleet": sample.fleet,
                "captured_at": sample.captured_at.isoformat(),
                "model_version": sample.model_version,
                "edge_label": sample.edge_predicted,
                "edge_confidence": round(sample.edge_confidence, 6),
                "teacher_label": verdict.label if verdict else None,
                "teacher_confidence": round(verdict.confidence, 6) if verdict else None,
                "route_reason": sample.route_reason,
                "image_key": sample.image_key,
                "image_format": sample.image_format,
            }
        )
    return rows


# --- dashboard ---------------------------------------------------------------


def _bucket(session: Session, column: Any, hours: int) -> Any:
    """A time bucket expression: an hour, or a day for long ranges."""
    if session.get_bind().dialect.name == "postgresql":
        return func.date_trunc("hour" if hours <= 72 else "day", column)
    return func.strftime("%Y-%m-%d %H:00" if hours <= 72 else "%Y-%m-%d", column)


def _key(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:00")
    return str(value)


def dashboard_series(*, session: Session, hours: int = 48) -> dict[str, Any]:
    """Time series per model version over the last ``hours``; computed in SQL."""
    since = datetime.now(UTC) - timedelta(hours=hours)
    b_sample = _bucket(session, Sample.captured_at, hours).label("b")
    forwarded = session.execute(
        select(b_sample, Sample.model_version, func.count())
        .where(Sample.captured_at >= since)
        .group_by(b_sample, Sample.model_version)
    ).all()
    agree = session.execute(
        select(
            b_sample,
            Sample.model_version,
            func.count(),
            func.sum(cast(Verdict.agrees_with_edge, Integer)),
            func.avg(Verdict.latency_s),
        )
        .join(Verdict, Verdict.sample_id == Sample.sample_id)
        .where(Sample.captured_at >= since)
        .group_by(b_sample, Sample.model_version)
    ).all()
    # Edge accuracy from audit samples: audits are drawn at random, so their
    # agreement with the best label (human, else teacher) estimates accuracy.
    newest = (
        select(Label.sample_id, func.max(Label.id).label("label_id"))
        .group_by(Label.sample_id)
        .subquery()
    )
    audits = session.execute(
        select(b_sample, Sample.model_version, Sample.edge_predicted, Verdict.label, Label.label)
        .join(Verdict, Verdict.sample_id == Sample.sample_id)
        .outerjoin(newest, newest.c.sample_id == Sample.sample_id)
        .outerjoin(Label, Label.id == newest.c.label_id)
        .where(Sample.captured_at >= since, Sample.route_reason == "audit")
        .limit(50_000)
    ).all()
    series: dict[str, dict[str, dict[str, float]]] = {
        "forwarded": {},
        "agreement": {},
        "accuracy": {},
        "latency_ms": {},
    }
    for bucket, version, count in forwarded:
        series["forwarded"].setdefault(version, {})[_key(bucket)] = float(count)
    for bucket, version, count, agreed, latency in agree:
        if count:
            series["agreement"].setdefault(version, {})[_key(bucket)] = float(agreed or 0) / count
        if latency is not None:
            series["latency_ms"].setdefault(version, {})[_key(bucket)] = float(latency) * 1000
    tally: dict[tuple[str, str], list[int]] = {}
    for bucket, version, edge, teacher, human in audits:
        truth = human if human is not None else teacher
        cell = tally.setdefault((version, _key(bucket)), [0, 0])
        cell[0] += int(edge == truth)
        cell[1] += 1
    for (version, bucket), (right, total) in tally.items():
        series["accuracy"].setdefault(version, {})[bucket] = right / total
    queue = dict(
        session.execute(
            select(Sample.status, func.count())
            .where(Sample.status.in_(["pending", "flagged"]))
            .group_by(Sample.status)
        ).all()
    )
    return {
        "series": series,
        "pending": int(queue.get("pending", 0)),
        "flagged": int(queue.get("flagged", 0)),
    }
