"""What the review UI exports and charts: labelled export rows and the dashboard's series."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from cloud_service.db.models import Label, Sample, Verdict
from cloud_service.exports import ExportRow
from cloud_service.ui.store.classes import ClassNames
from cloud_service.ui.store.queue import QueueFilter

__all__ = ["dashboard_series", "export_rows"]


def export_rows(
    *, session: Session, flt: QueueFilter, classes: ClassNames, limit: int = 100_000
) -> list[ExportRow]:
    """The samples under the filter (its status included), in its order, with their labels.

    A sample's label is its newest human label (reviewed), else the teacher's
    (verified, flagged), else none (pending; discarded: a human turned it down).
    """
    newest = (
        select(Label.sample_id, func.max(Label.id).label("label_id"))
        .group_by(Label.sample_id)
        .subquery()
    )
    stmt = (
        select(Sample, Verdict, Label)
        .outerjoin(Verdict, Verdict.sample_id == Sample.sample_id)
        .outerjoin(newest, newest.c.sample_id == Sample.sample_id)
        .outerjoin(Label, Label.id == newest.c.label_id)
        .where(*flt.conditions(classes))
        .order_by(*flt.order_by())
        .limit(limit)
    )
    rows = []
    for sample, verdict, label in session.execute(stmt).all():
        names = classes.for_sample(sample)
        chosen: int | None = None
        boxes: list[Any] | None = None
        source = labeled_by = None
        labeled_at = None
        if sample.status == "reviewed" and label is not None:
            boxes = label.boxes
            chosen, source, labeled_by, labeled_at = (
                label.label,
                "human",
                label.labeled_by,
                label.created_at,
            )
        elif sample.status in ("verified", "flagged") and verdict is not None:
            boxes = verdict.boxes
            chosen, source, labeled_by, labeled_at = (
                verdict.label,
                "teacher",
                verdict.teacher_version,
                verdict.verified_at,
            )
        name = None
        if chosen is not None:
            name = names[chosen] if 0 <= chosen < len(names) else str(chosen)
        rows.append(
            ExportRow(
                sample_id=sample.sample_id,
                label=chosen,
                class_name=name,
                source=source,
                labeled_by=labeled_by,
                labeled_at=labeled_at,
                status=sample.status,
                agent_id=sample.agent_id,
                fleet=sample.fleet,
                captured_at=sample.captured_at,
                model_name=sample.model_name,
                model_version=sample.model_version,
                classes=tuple(names),
                edge_label=sample.edge_predicted,
                edge_confidence=sample.edge_confidence,
                teacher_label=verdict.label if verdict else None,
                teacher_confidence=verdict.confidence if verdict else None,
                teacher_model=verdict.teacher_model if verdict else None,
                teacher_version=verdict.teacher_version if verdict else None,
                route_reason=sample.route_reason,
                image_key=sample.image_key,
                image_format=sample.image_format,
                image_width=sample.image_width,
                image_height=sample.image_height,
                boxes=_boxes(boxes),
                edge_boxes=_boxes(sample.edge_boxes),
                teacher_boxes=_boxes(verdict.boxes if verdict else None),
            )
        )
    return rows


def _boxes(stored: list[Any] | None) -> tuple[tuple[float, ...], ...] | None:
    """Stored boxes ``[x1, y1, x2, y2, (score,) class]`` as tuples; None: not a detector's."""
    if stored is None:
        return None
    return tuple(tuple(float(v) for v in box) for box in stored)


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
