"""The review queue: its filter (round-tripping through the URL), pages, and neighbours."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from cloud_service.db.models import Sample, Verdict
from cloud_service.ui.store.classes import ClassNames
from shared.errors import ContractError

__all__ = [
    "MAX_BULK",
    "PAGE_SIZES",
    "ROUTE_REASONS",
    "SAMPLE_STATUSES",
    "SORTS",
    "STATUSES",
    "QueueFilter",
    "QueuePage",
    "neighbour",
    "queue_page",
]

SORTS: dict[str, tuple[str, bool]] = {
    # name: (column, descending); sample_id breaks ties in the same direction.
    "newest": ("captured_at", True),
    "oldest": ("captured_at", False),
    "confidence": ("edge_confidence", False),
    "-confidence": ("edge_confidence", True),
}
STATUSES = ("flagged", "verified", "reviewed", "discarded", "pending", "any")
SAMPLE_STATUSES = STATUSES[:-1]
ROUTE_REASONS = ("low_confidence", "margin", "entropy", "class_threshold", "audit", "manual")
PAGE_SIZES = (25, 50, 100, 200)
MAX_BULK = max(PAGE_SIZES)  # a bulk action takes at most one page of samples


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

    def conditions(self, classes: ClassNames) -> list[Any]:
        """The WHERE terms on samples (and verdicts, for the teacher class).

        A class filter is a class name (of the sample's own model) or an index.
        """
        terms: list[Any] = []
        if self.status != "any":
            terms.append(Sample.status == self.status)
        if self.agent:
            terms.append(Sample.agent_id == self.agent)
        if self.fleet:
            terms.append(Sample.fleet == self.fleet)
        if self.edge_class:
            terms.append(classes.condition(Sample.edge_predicted, self.edge_class, what="edge"))
        if self.teacher_class:
            terms.append(classes.condition(Verdict.label, self.teacher_class, what="teacher"))
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


def _joined(flt: QueueFilter, classes: ClassNames) -> Any:
    return (
        select(Sample, Verdict)
        .outerjoin(Verdict, Verdict.sample_id == Sample.sample_id)
        .where(*flt.conditions(classes))
    )


@dataclass
class QueuePage:
    rows: list[tuple[Sample, Verdict | None]]
    total: int
    pages: int


def queue_page(*, session: Session, flt: QueueFilter, classes: ClassNames) -> QueuePage:
    """One page of the queue (newest first by default) and the filter's total count."""
    count = select(func.count()).select_from(Sample)
    if flt.teacher_class:
        count = count.join(Verdict, Verdict.sample_id == Sample.sample_id)
    total = int(session.scalar(count.where(*flt.conditions(classes))) or 0)
    stmt = (
        _joined(flt, classes)
        .order_by(*flt.order_by())
        .limit(flt.per_page)
        .offset((flt.page - 1) * flt.per_page)
    )
    rows = [(s, v) for s, v in session.execute(stmt).all()]
    return QueuePage(rows=rows, total=total, pages=max(1, -(-total // flt.per_page)))


def neighbour(
    *,
    session: Session,
    flt: QueueFilter,
    classes: ClassNames,
    sample: Sample,
    forward: bool = True,
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
    row = session.execute(_joined(flt, classes).where(after).order_by(*order).limit(1)).first()
    return (row[0], row[1]) if row else None
