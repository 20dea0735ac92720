"""Reviews of samples, one at a time or in bulk, each with its undo.

Reviews are optimistic: the page carries the sample's *review token* (its status
and the id of its newest label, ``"flagged:0"``); a write whose token no longer
matches is refused with ConflictError (409) instead of overwriting what another
reviewer did meanwhile. The status check is a conditional UPDATE, so two reviewers
racing on PostgreSQL cannot both win.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from cloud_service.db.models import Label, Sample, Verdict
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.ui.store.classes import ClassNames
from cloud_service.ui.store.queue import MAX_BULK, SAMPLE_STATUSES
from shared.errors import ContractError

__all__ = [
    "BulkResult",
    "ReviewResult",
    "bulk_review",
    "review_sample",
    "review_token",
    "sample_view",
    "undo_bulk",
    "undo_review",
]


def review_token(*, session: Session, sample: Sample) -> str:
    """The sample's current review state: status and newest label id."""
    newest = session.scalar(select(func.max(Label.id)).where(Label.sample_id == sample.sample_id))
    return f"{sample.status}:{newest or 0}"


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
