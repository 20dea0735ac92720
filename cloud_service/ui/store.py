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

import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from sqlalchemy import Integer, and_, cast, delete, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from cloud_service.db.models import FleetModel, Label, ModelVersion, Sample, Verdict
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.exports import ExportRow
from shared.errors import ContractError

if TYPE_CHECKING:
    from cloud_service.api.state import ApiState

__all__ = [
    "BulkResult",
    "ClassNames",
    "QueueFilter",
    "ReviewResult",
    "bulk_review",
    "class_names_for",
    "dashboard_series",
    "export_rows",
    "model_file_labels",
    "neighbour",
    "queue_page",
    "review_sample",
    "review_token",
    "sample_view",
    "undo_bulk",
    "undo_review",
]

log = logging.getLogger(__name__)

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


def review_token(*, session: Session, sample: Sample) -> str:
    """The sample's current review state: status and newest label id."""
    newest = session.scalar(select(func.max(Label.id)).where(Label.sample_id == sample.sample_id))
    return f"{sample.status}:{newest or 0}"


def _index_names(n: int) -> list[str]:
    return [str(i) for i in range(n)]


_FILE_LABELS: dict[tuple[str, int, int], tuple[str, ...]] = {}
_FILE_LABELS_LOCK = threading.Lock()


def model_file_labels(path: Path) -> tuple[str, ...]:
    """The class names in an ONNX file's ``edgeloop.labels`` metadata (cached), else ().

    Reads the metadata only (no inference session): the UI uses the teacher's
    names for samples whose model the registry does not know.
    """
    try:
        stat = path.stat()
    except OSError:
        return ()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    with _FILE_LABELS_LOCK:
        if key in _FILE_LABELS:
            return _FILE_LABELS[key]
    labels: tuple[str, ...] = ()
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}
        parsed = json.loads(meta.get("edgeloop.labels", "null"))
        if isinstance(parsed, list):
            labels = tuple(str(x) for x in parsed)
    except Exception as exc:  # a broken or foreign file: no names, the UI shows indices
        log.warning("no class names from %s: %s", path, exc)
    with _FILE_LABELS_LOCK:
        _FILE_LABELS[key] = labels
    return labels


class ClassNames:
    """The class names of the fleet's models, looked up once per request.

    For a sample's model (name, version, class count) the names come from, in order:
    the registered version's manifest; the version its fleet serves; the newest
    registered version of the same model name; ``fallback`` (the teacher's names);
    each only when its count matches. Indices "0".."n-1" when none is known.
    """

    def __init__(self, session: Session, *, fallback: Sequence[str] = ()) -> None:
        self._session = session
        self._fallback = list(fallback) if _named(fallback) else []
        self._versions: dict[str, list[tuple[str, list[str]]]] = {}
        self._fleets: dict[str, tuple[str, str] | None] = {}
        self._memo: dict[tuple[str, str, str, int], list[str]] = {}
        self._pairs: list[tuple[str, str, list[str]]] | None = None

    def _registered(self, model_name: str) -> list[tuple[str, list[str]]]:
        if model_name not in self._versions:
            rows = self._session.execute(
                select(ModelVersion.version, ModelVersion.manifest)
                .where(ModelVersion.name == model_name)
                .order_by(ModelVersion.id.desc())
            ).all()
            found = []
            for version, manifest in rows:
                labels = manifest.get("labels") if isinstance(manifest, dict) else None
                if isinstance(labels, list):
                    found.append((version, [str(x) for x in labels]))
            self._versions[model_name] = found
        return self._versions[model_name]

    def _serving(self, fleet: str) -> tuple[str, str] | None:
        if fleet not in self._fleets:
            record = self._session.get(FleetModel, fleet) if fleet else None
            self._fleets[fleet] = (record.model_name, record.version) if record else None
        return self._fleets[fleet]

    def of(self, model_name: str, model_version: str, n: int, *, fleet: str = "") -> list[str]:
        """The names of the classes 0..n-1 of this model version."""
        key = (model_name, model_version, fleet, n)
        if key in self._memo:
            return self._memo[key]
        candidates: list[list[str]] = []
        registered = self._registered(model_name)
        candidates += [labels for version, labels in registered if version == model_version]
        serving = self._serving(fleet)
        if serving is not None:
            candidates += [
                labels for version, labels in self._registered(serving[0]) if version == serving[1]
            ]
        candidates += [labels for _, labels in registered]
        candidates.append(self._fallback)
        names = next((c for c in candidates if len(c) == n), None) or _index_names(n)
        self._memo[key] = names
        return names

    def for_sample(self, sample: Sample) -> list[str]:
        return self.of(
            sample.model_name, sample.model_version, len(sample.edge_scores), fleet=sample.fleet
        )

    def _stored_models(self) -> list[tuple[str, str, list[str]]]:
        """Each (model name, version) that samples carry, with its class names."""
        if self._pairs is None:
            firsts = self._session.execute(
                select(func.min(Sample.sample_id)).group_by(Sample.model_name, Sample.model_version)
            ).scalars()
            ids = list(firsts)
            pairs = []
            for sample in self._session.scalars(select(Sample).where(Sample.sample_id.in_(ids))):
                pairs.append((sample.model_name, sample.model_version, self.for_sample(sample)))
            self._pairs = pairs
        return self._pairs

    def known(self) -> list[str]:
        """Every class name the registered models and the teacher have (form suggestions)."""
        names: dict[str, None] = {}
        for (manifest,) in self._session.execute(select(ModelVersion.manifest).limit(1000)):
            labels = manifest.get("labels") if isinstance(manifest, dict) else None
            if isinstance(labels, list) and _named([str(x) for x in labels]):
                names.update(dict.fromkeys(str(x) for x in labels))
        names.update(dict.fromkeys(self._fallback))
        return list(names)

    def condition(self, column: Any, text: str, *, what: str) -> Any:
        """A WHERE term: ``column`` (a class index) is the class named ``text``, or index."""
        terms = [
            and_(Sample.model_name == name, Sample.model_version == version, column == i)
            for name, version, labels in self._stored_models()
            for i, label in enumerate(labels)
            if label == text
        ]
        if terms:
            return or_(*terms)
        if text.isdigit():
            return column == int(text)
        known = self.known()
        hint = f"; known classes: {', '.join(known[:50])}" if known else ""
        raise ContractError(
            f"{what} {text!r} is neither a class name nor a class index{hint}",
            reason="invalid_filter",
        )

    def index(self, sample: Sample, text: str) -> int:
        """The class index of name (or index) ``text`` for ``sample``; ContractError if none."""
        names = self.for_sample(sample)
        if text in names:
            return names.index(text)
        if text.isdigit() and int(text) < len(names):
            return int(text)
        raise ContractError(
            f"{text!r} is not a class of sample {sample.sample_id}: use one of {', '.join(names)}",
            reason="invalid_label",
        )


def class_names_for(*, session: Session, state: ApiState) -> ClassNames:
    """The class-name lookup of one request; the teacher's names are the fallback."""
    if state.worker is not None:
        fallback: tuple[str, ...] = state.worker.teacher.info.labels
    else:
        fallback = model_file_labels(state.settings.resolved_teacher_model)
    return ClassNames(session, fallback=fallback)


def _named(labels: Sequence[str]) -> bool:
    """Whether ``labels`` are names rather than the indices themselves."""
    return bool(labels) and list(labels) != _index_names(len(labels))


def sample_view(
    *,
    session: Session,
    sample: Sample,
    verdict: Verdict | None,
    classes: ClassNames,
    with_labels: bool = True,
) -> dict[str, Any]:
    """A sample as the review page's JavaScript draws it (JSON-safe)."""
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
        "classes": classes.for_sample(sample),
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


@dataclass(frozen=True)
class BulkResult:
    """What a bulk action did: the samples done (with the status each had), those skipped."""

    action: str
    done: list[tuple[str, str]]
    skipped: list[str]


def bulk_review(
    *,
    session: Session,
    sample_ids: Sequence[str],
    action: str,
    label: str,
    reviewer: str,
    classes: ClassNames,
    expected_status: str = "flagged",
) -> BulkResult:
    """Review many samples; ``confirm`` takes each one's teacher label.

    ``label`` (relabel) is a class name or index, checked against each sample's own
    classes; a sample that does not have it refuses the whole action. A sample no
    longer in ``expected_status`` (someone else reviewed it) is skipped and
    reported, never overwritten.
    """
    if action not in ("confirm", "relabel", "discard"):
        raise ContractError(
            f"bulk action {action!r} is not confirm, relabel or discard", reason="invalid_action"
        )
    if action == "relabel" and not label.strip():
        raise ContractError("relabel needs a class name or index", reason="invalid_label")
    if not sample_ids:
        raise ContractError("no samples selected: tick at least one row", reason="invalid")
    if len(sample_ids) > MAX_BULK:
        raise ContractError(f"a bulk action takes at most {MAX_BULK} samples", reason="invalid")
    done: list[tuple[str, str]] = []
    skipped: list[str] = []
    verdicts = {v.sample_id: v for v in _verdicts(session, sample_ids)}
    for sample_id in dict.fromkeys(sample_ids):
        sample = session.get(Sample, sample_id)
        if sample is None or sample.status != expected_status:
            skipped.append(sample_id)
            continue
        chosen: int | None = None
        if action == "confirm":
            verdict = verdicts.get(sample_id)
            chosen = verdict.label if verdict else sample.edge_predicted
        elif action == "relabel":
            chosen = classes.index(sample, label.strip())
        new_status = "discarded" if action == "discard" else "reviewed"
        if not _set_status(session, sample_id, expected_status, new_status):
            skipped.append(sample_id)
            continue
        if chosen is not None:
            session.add(Label(sample_id=sample_id, label=chosen, labeled_by=reviewer))
        done.append((sample_id, expected_status))
    session.flush()
    return BulkResult(action=action, done=done, skipped=skipped)


def undo_bulk(
    *, session: Session, items: Sequence[tuple[str, str]], from_status: str = "discarded"
) -> BulkResult:
    """Give samples back the status they had before a bulk discard.

    Only a sample still in ``from_status`` is restored; one that changed meanwhile
    (someone reviewed it again) is skipped, never overwritten.
    """
    done: list[tuple[str, str]] = []
    skipped: list[str] = []
    for sample_id, previous in items:
        if previous not in SAMPLE_STATUSES or previous == from_status:
            raise ContractError(f"status {previous!r} is not one to restore", reason="invalid")
        if _set_status(session, sample_id, from_status, previous):
            done.append((sample_id, previous))
        else:
            skipped.append(sample_id)
    session.flush()
    return BulkResult(action="undo", done=done, skipped=skipped)


def _verdicts(session: Session, sample_ids: Iterable[str]) -> list[Verdict]:
    ids = list(sample_ids)
    if not ids:
        return []
    return list(session.scalars(select(Verdict).where(Verdict.sample_id.in_(ids))))


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
        source = labeled_by = None
        labeled_at = None
        if sample.status == "reviewed" and label is not None:
            chosen, source, labeled_by, labeled_at = (
                label.label,
                "human",
                label.labeled_by,
                label.created_at,
            )
        elif sample.status in ("verified", "flagged") and verdict is not None:
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
            )
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
