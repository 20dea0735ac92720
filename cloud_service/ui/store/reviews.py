"""Reviews of samples, one at a time or in bulk, each with its undo.

Reviews are optimistic: the page carries the sample's *review token* (its status
and the id of its newest label, ``"flagged:0"``); a write whose token no longer
matches is refused with ConflictError (409) instead of overwriting what another
reviewer did meanwhile. The status check is a conditional UPDATE, so two reviewers
racing on PostgreSQL cannot both win.

A detection sample (its ``edge_boxes`` are not NULL) is reviewed box by box: its view
carries the edge's and the teacher's boxes, what differs between them (per box, from
:func:`shared.tasks.detection.match`) and its class names; its label is a list of
boxes, stored with the Label row (``label`` is then the first box's class, or 0 for an
empty frame). A classification sample's view and review are as they always were.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from cloud_service.db.models import FleetModel, Label, ModelVersion, Sample, Verdict
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.ui.store.classes import ClassNames
from cloud_service.ui.store.queue import MAX_BULK, SAMPLE_STATUSES
from shared.errors import ContractError
from shared.tasks.contract import Box
from shared.tasks.detection import match

__all__ = [
    "BOX_FORM",
    "MAX_BOXES",
    "BulkResult",
    "ReviewResult",
    "box_differences",
    "bulk_review",
    "checked_label_boxes",
    "detection_classes",
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


MAX_BOXES = 300  # boxes a reviewer may put in one frame
BOX_FORM = (
    "[x1, y1, x2, y2, class] per box, corners as fractions of the frame "
    "(0 <= x1 < x2 <= 1, 0 <= y1 < y2 <= 1), class an integer class index"
)
DIGIT_KEYS = 10  # classes the review page's digit keys reach; unnamed classes get these many


def sample_view(
    *,
    session: Session,
    sample: Sample,
    verdict: Verdict | None,
    classes: ClassNames,
    with_labels: bool = True,
) -> dict[str, Any]:
    """A sample as the review page's JavaScript draws it (JSON-safe).

    A detection sample's view adds ``task: "detection"`` and its boxes (see
    :func:`_detection_fields`); a classification sample's has no ``task`` key.
    """
    labels: list[dict[str, Any]] = []
    rows: list[Label] = []
    if with_labels:
        rows = list(
            session.scalars(
                select(Label).where(Label.sample_id == sample.sample_id).order_by(Label.id)
            )
        )
        for label in rows:
            entry: dict[str, Any] = {
                "label": label.label,
                "by": label.labeled_by,
                "at": label.created_at.isoformat(),
            }
            if label.boxes is not None:
                entry["boxes"] = label.boxes
            labels.append(entry)
    view: dict[str, Any] = {
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
    if sample.edge_boxes is not None:
        if not with_labels:
            newest = session.scalars(
                select(Label).where(Label.sample_id == sample.sample_id).order_by(Label.id.desc())
            ).first()
            rows = [newest] if newest is not None else []
        view.update(_detection_fields(session, sample, verdict, rows))
    return view


def _detection_fields(
    session: Session, sample: Sample, verdict: Verdict | None, labels: Sequence[Label]
) -> dict[str, Any]:
    """What the box editor draws: both answers' boxes, the newest human boxes, and which
    boxes differ (``differences`` is None until the teacher has answered)."""
    edge = [list(b) for b in sample.edge_boxes or []]
    teacher = [list(b) for b in verdict.boxes or []] if verdict is not None else None
    human = next((list(label.boxes) for label in reversed(labels) if label.boxes is not None), None)
    seen = [*edge, *(teacher or []), *(human or [])]
    needed = max((int(b[5]) + 1 for b in seen), default=0)
    return {
        "task": "detection",
        "classes": detection_classes(session=session, sample=sample, needed=needed),
        "edge_boxes": edge,
        "teacher_boxes": teacher,
        "label_boxes": human,
        "differences": box_differences(edge, teacher) if teacher is not None else None,
    }


def box_differences(
    edge: Sequence[Sequence[float]], teacher: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """Which boxes of the two answers differ, per box, by :func:`match` (IoU matching).

    ``teacher[i]`` is "matched", "missed", "wrong_class" or "localisation";
    ``edge[j]`` is "matched", "extra", or the kind of the teacher box it pairs with
    ("wrong_class", "localisation"), so both sides of a differing pair stand out.
    ``pairs`` are ``[edge index, teacher index, IoU]`` of every pairing, ``kinds`` the
    kinds of difference present.
    """
    found = match([_box(b) for b in edge], [_box(b) for b in teacher])
    edge_status = ["extra"] * len(edge)
    teacher_status = ["missed"] * len(teacher)
    pairs: list[list[float]] = []
    wrong = set(found.wrong_class)
    for s, t, iou in found.pairs:
        kind = "wrong_class" if (s, t) in wrong else "matched"
        edge_status[s] = teacher_status[t] = kind
        pairs.append([s, t, round(iou, 4)])
    for s, t, iou in found.localisation:
        edge_status[s] = teacher_status[t] = "localisation"
        pairs.append([s, t, round(iou, 4)])
    return {
        "edge": edge_status,
        "teacher": teacher_status,
        "pairs": sorted(pairs),
        "kinds": list(found.differences),
    }


def _box(row: Sequence[float]) -> Box:
    return (float(row[0]), float(row[1]), float(row[2]), float(row[3]), float(row[4]), int(row[5]))


def detection_classes(*, session: Session, sample: Sample, needed: int = 0) -> list[str]:
    """The class names of a detection sample's model, from the registry's manifests.

    In order: the sample's own model version, the version its fleet serves, the
    newest registered version of the same model name; the first whose labels cover
    every class index in use (``needed``). Else indices "0".."n-1", at least as many
    as the digit keys reach. (A detection sample's ``edge_scores`` are its boxes'
    scores, so ClassNames' count check does not apply to it.)
    """
    wanted: list[tuple[str, str | None]] = [(sample.model_name, sample.model_version)]
    serving = session.get(FleetModel, sample.fleet) if sample.fleet else None
    if serving is not None:
        wanted.append((serving.model_name, serving.version))
    wanted.append((sample.model_name, None))
    for name, version in wanted:
        stmt = select(ModelVersion.manifest).where(ModelVersion.name == name)
        if version is not None:
            stmt = stmt.where(ModelVersion.version == version)
        for manifest in session.scalars(stmt.order_by(ModelVersion.id.desc()).limit(20)):
            labels = manifest.get("labels") if isinstance(manifest, dict) else None
            if isinstance(labels, list) and labels and len(labels) >= needed:
                return [str(x) for x in labels]
    return [str(i) for i in range(max(needed, DIGIT_KEYS))]


def checked_label_boxes(boxes: Any, classes: int) -> list[list[float | int]]:
    """A reviewer's boxes ``[x1, y1, x2, y2, class]`` as stored rows (score 1.0 added).

    Refused with a ContractError (422) that names the accepted form: more than
    MAX_BOXES boxes, a box that is not five finite numbers, corners outside the frame
    or not ordered, a class that is not an integer index below ``classes``.
    """
    if not isinstance(boxes, list | tuple):
        raise ContractError(f"boxes must be a list of {BOX_FORM}", reason="invalid_boxes")
    if len(boxes) > MAX_BOXES:
        raise ContractError(
            f"{len(boxes)} boxes: a frame takes at most {MAX_BOXES} boxes", reason="invalid_boxes"
        )
    rows: list[list[float | int]] = []
    for i, box in enumerate(boxes):
        numbers = isinstance(box, list | tuple) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box
        )
        if not numbers or len(box) != 5:
            raise ContractError(f"box {i} is {box!r}: expected {BOX_FORM}", reason="invalid_boxes")
        x1, y1, x2, y2 = (float(v) for v in box[:4])
        if not (0.0 <= x1 < x2 <= 1.0 and 0.0 <= y1 < y2 <= 1.0):
            raise ContractError(
                f"box {i} {list(box)} is not inside the frame: expected {BOX_FORM}",
                reason="invalid_boxes",
            )
        cls = box[4]
        if float(cls) != int(cls) or not 0 <= int(cls) < classes:
            raise ContractError(
                f"box {i} has class {cls}: a class is an integer 0..{classes - 1}",
                reason="invalid_boxes",
            )
        rows.append([x1, y1, x2, y2, 1.0, int(cls)])
    return rows


def human_boxes(boxes: Sequence[Sequence[float]]) -> list[list[float | int]]:
    """Boxes a human accepted (a teacher's, an edge's) as label rows: score 1.0."""
    return [[float(b[0]), float(b[1]), float(b[2]), float(b[3]), 1.0, int(b[5])] for b in boxes]


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
    boxes: list[list[float | int]] | None = None  # a detection label's stored boxes


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
    boxes: Any = None,
) -> ReviewResult:
    """Confirm or relabel (``action="label"``) or discard a sample, if ``token`` still holds.

    A detection sample is labelled with ``boxes`` (:data:`BOX_FORM`, checked by
    :func:`checked_label_boxes`; ``label`` is ignored), a classification sample with
    ``label``; sending the other kind is refused.
    """
    sample = session.get(Sample, sample_id)
    if sample is None:
        raise NotFoundError(f"sample {sample_id} is not stored")
    current = review_token(session=session, sample=sample)
    if token != current:
        raise ConflictError(_conflict_message(session, sample, current))
    previous = sample.status
    rows: list[list[float | int]] | None = None
    if action == "discard":
        new_status = "discarded"
    elif action == "label" and sample.edge_boxes is not None:
        if boxes is None:
            raise ContractError(
                f"a detection sample is labelled with boxes: a list of {BOX_FORM}",
                reason="invalid_boxes",
            )
        rows = checked_label_boxes(boxes, len(_classes_of(session, sample)))
        label = int(rows[0][5]) if rows else 0
        new_status = "reviewed"
    elif action == "label":
        if boxes is not None:
            raise ContractError(
                "this is a classification sample: label it with a class index, not boxes",
                reason="invalid_label",
            )
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
        record = Label(sample_id=sample_id, label=int(label or 0), boxes=rows, labeled_by=reviewer)
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
        boxes=rows,
    )


def _classes_of(session: Session, sample: Sample) -> list[str]:
    """A detection sample's class names, covering the classes its answers use."""
    verdict = session.scalars(select(Verdict).where(Verdict.sample_id == sample.sample_id)).first()
    seen = [*(sample.edge_boxes or []), *((verdict.boxes or []) if verdict else [])]
    needed = max((int(b[5]) + 1 for b in seen), default=0)
    return detection_classes(session=session, sample=sample, needed=needed)


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

    For a detection sample ``confirm`` takes the teacher's boxes (the edge's when the
    teacher has not answered); ``relabel`` (one class for a whole frame) refuses it.

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
        boxes: list[list[float | int]] | None = None
        detection = sample.edge_boxes is not None
        if action == "confirm":
            verdict = verdicts.get(sample_id)
            chosen = verdict.label if verdict else sample.edge_predicted
            if detection:
                taken = verdict.boxes if verdict and verdict.boxes is not None else None
                boxes = human_boxes(taken if taken is not None else sample.edge_boxes or [])
                chosen = int(boxes[0][5]) if boxes else 0
        elif action == "relabel" and detection:
            raise ContractError(
                f"sample {sample_id} is a detection sample: relabel takes classification "
                "samples only; edit its boxes on its review page, or confirm the teacher's",
                reason="invalid_label",
            )
        elif action == "relabel":
            chosen = classes.index(sample, label.strip())
        new_status = "discarded" if action == "discard" else "reviewed"
        if not _set_status(session, sample_id, expected_status, new_status):
            skipped.append(sample_id)
            continue
        if chosen is not None:
            session.add(Label(sample_id=sample_id, label=chosen, boxes=boxes, labeled_by=reviewer))
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
