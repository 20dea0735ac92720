"""The samples a distillation job trains and is judged on: read, decoded, split, recorded.

The verified samples (teacher verdict; a human label overrides the teacher's), newest
first. The fleet's class set and frame size are the serving student's. The held-out
share the gate judges on is, for the reference scenario, the newest ``holdout_share``
(the drift the round answers); for a fleet of its own classes, a stable hash of the
sample id picks it, so a sample held out once stays held out in later rounds. A seeded
``val_share`` of the rest is for early stopping, the remainder trains. Identical frames
(a static camera sends the same picture again) count once and stay on one side of the
split. Each class needs ``min_per_class`` labelled frames. The ids are stored
(``dataset_snapshots``), so a model version can be traced to the exact samples it saw.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import FleetModel, Label, ModelVersion, Sample, Verdict
from cloud_service.jobs.context import JobContext
from cloud_service.jobs.params import JobParams
from cloud_service.jobs.services import PipelineServices, blob_to_file
from cloud_service.jobs.tables import DatasetSnapshot, DistillJob
from distill.distillation import (
    LabelledFrames,
    ReferenceSets,
    VerifiedSplit,
    check_per_class,
    soft_targets,
)
from distill.export import read_onnx_info
from shared.errors import DataError, ModelError

__all__ = [
    "TRAINABLE_STATUSES",
    "DistinctFrame",
    "FleetState",
    "ServingModel",
    "ServingStudent",
    "Snapshot",
    "VerifiedRow",
    "decode_frame",
    "distinct_frames",
    "keep_known_classes",
    "read_fleet",
    "serving_student",
    "split_frames",
    "take_snapshot",
    "verified_rows",
]

TRAINABLE_STATUSES: tuple[str, ...] = ("verified", "reviewed", "flagged")


@dataclass(frozen=True)
class VerifiedRow:
    """One verified sample: its frame's blob, the label trained on, the teacher's answer."""

    sample_id: str
    image_key: str
    label: int
    teacher_label: int
    scores: list[float]
    human: bool


@dataclass(frozen=True)
class ServingModel:
    """The registry entry the fleet serves."""

    name: str
    version: str
    artifact_key: str


@dataclass(frozen=True)
class FleetState:
    """What the database holds for a job: the samples, the serving model, and the
    checkpoint of the job that made it (the warm start)."""

    rows: list[VerifiedRow]
    serving: ServingModel | None
    parent_checkpoint: str | None
    parent_job_id: int | None


def verified_rows(session: Session, fleet: str, limit: int) -> list[VerifiedRow]:
    """Verified samples of the fleet, newest first; a human's latest label wins."""
    pairs = session.execute(
        select(Sample.sample_id, Sample.image_key, Verdict.label, Verdict.scores)
        .join(Verdict, Verdict.sample_id == Sample.sample_id)
        .where(Sample.fleet == fleet, Sample.status.in_(TRAINABLE_STATUSES))
        .order_by(Verdict.verified_at.desc(), Sample.sample_id.desc())
        .limit(limit)
    ).all()
    ids = [p[0] for p in pairs]
    human: dict[str, int] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for sid, label in session.execute(
            select(Label.sample_id, Label.label)
            .where(Label.sample_id.in_(chunk))
            .order_by(Label.created_at, Label.id)
        ):
            human[sid] = int(label)  # later rows overwrite: the latest label wins
    return [
        VerifiedRow(
            sample_id=sid,
            image_key=key,
            label=human.get(sid, int(tlabel)),
            teacher_label=int(tlabel),
            scores=[float(x) for x in scores],
            human=sid in human,
        )
        for sid, key, tlabel, scores in pairs
    ]


def _serving(session: Session, fleet: str) -> ModelVersion | None:
    current = session.get(FleetModel, fleet)
    if current is None:
        return None
    return session.scalars(
        select(ModelVersion).where(
            ModelVersion.name == current.model_name, ModelVersion.version == current.version
        )
    ).first()


def read_fleet(sessions: Callable[[], Session], p: JobParams) -> FleetState:
    """The fleet's verified samples and serving model; DataError below ``min_samples``."""
    with sessions() as session:
        rows = verified_rows(session, p.fleet, p.max_samples)
        record = _serving(session, p.fleet)
        serving = (
            None
            if record is None
            else ServingModel(record.name, record.version, record.artifact_key)
        )
        parent_job = (
            None
            if record is None
            else session.scalars(
                select(DistillJob).where(DistillJob.result_version == record.version)
            ).first()
        )
        parent_ckpt = None if parent_job is None else parent_job.metrics.get("checkpoint_key")
        parent_job_id = None if parent_job is None else parent_job.id
    if len(rows) < p.min_samples:
        raise DataError(
            f"only {len(rows)} verified samples for fleet {p.fleet!r}; the job needs"
            f" at least {p.min_samples} (min_samples)"
        )
    return FleetState(rows, serving, parent_ckpt, parent_job_id)


@dataclass(frozen=True)
class ServingStudent:
    """The serving student's file, whose class set, frame size and task the fleet's are."""

    path: Path
    classes: tuple[str, ...]
    frame_size: int
    task: str | None = None  # shared.tasks; None: classification


def serving_student(
    services: PipelineServices, p: JobParams, serving: ServingModel | None, work: Path
) -> ServingStudent:
    """The registered serving model, else ``serving_model``, else the worker's default."""
    if serving is not None:
        path = blob_to_file(services.blobs, serving.artifact_key, work / "serving.onnx")
    elif p.serving_model:
        path = Path(p.serving_model)
    elif services.serving_model is not None:
        path = services.serving_model
    else:
        raise ModelError("no serving student to compare with (serving_model)")
    # Every sample's label indexes into its classes; the new student answers with them.
    info = read_onnx_info(path)
    return ServingStudent(path, info.labels, info.frame_size, info.metadata.get("task"))


def keep_known_classes(rows: list[VerifiedRow], classes: int, ctx: JobContext) -> list[VerifiedRow]:
    """The rows whose label is one of the fleet's ``classes`` (the rest logged, left out)."""
    outside = [r for r in rows if not 0 <= r.label < classes]
    if not outside:
        return rows
    ctx.log(
        f"{len(outside)} sample(s) labelled outside the fleet's {classes} classes left out",
        level="warning",
    )
    return [r for r in rows if 0 <= r.label < classes]


@dataclass(frozen=True)
class DistinctFrame:
    """One distinct picture among the verified samples. A static camera sends the same
    frame again; its copies count once and stay on one side of every split, or the
    holdout the gate judges on would hold frames the new student trained on."""

    row: VerifiedRow  # the newest copy, with the newest human label of any copy
    sample_ids: tuple[str, ...]
    pixels: np.ndarray
    key: str


def distinct_frames(rows: Sequence[VerifiedRow], pixels: np.ndarray) -> list[DistinctFrame]:
    """Rows (newest first) grouped by identical decoded pixels, newest group first."""
    groups: dict[str, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(hashlib.sha256(pixels[i].tobytes()).hexdigest(), []).append(i)
    out = []
    for key, members in groups.items():
        copies = [rows[i] for i in members]
        newest, human = copies[0], next((r for r in copies if r.human), None)
        if human is not None and not newest.human:
            newest = replace(newest, label=human.label, human=True)
        ids = tuple(r.sample_id for r in copies)
        out.append(DistinctFrame(newest, ids, pixels[members[0]], key))
    return out


def split_frames(
    frames: list[DistinctFrame], p: JobParams, *, by: str = "recent"
) -> tuple[list[DistinctFrame], list[DistinctFrame], list[DistinctFrame]]:
    """(train, val, holdout). ``by="recent"``: the newest share is the holdout;
    ``by="sample-id"``: a stable hash of each picture's first sample id picks it, so a
    sample held out once stays held out in every later round. Val by a stable hash."""

    def share(f: DistinctFrame, salt: str) -> float:
        h = hashlib.sha256(f"{salt}/{f.key if salt != 'holdout' else min(f.sample_ids)}".encode())
        return int.from_bytes(h.digest()[:4], "big") / 2**32

    if by == "sample-id":
        holdout = [f for f in frames if share(f, "holdout") < p.holdout_share]
        if not holdout and frames:
            holdout = [min(frames, key=lambda f: share(f, "holdout"))]
        held = {id(f) for f in holdout}
        rest = [f for f in frames if id(f) not in held]
    else:
        n_hold = max(1, round(len(frames) * p.holdout_share))
        holdout, rest = frames[:n_hold], frames[n_hold:]

    def in_val(f: DistinctFrame) -> bool:
        return share(f, str(p.seed)) < p.val_share

    val = [f for f in rest if in_val(f)]
    train = [f for f in rest if not in_val(f)]
    return train, val, holdout


def decode_frame(data: bytes, size: int) -> np.ndarray:
    """A stored frame as uint8 RGB at ``size`` x ``size`` (resized when it is not)."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8)


def _labelled(part: Sequence[DistinctFrame], classes: int, size: int) -> LabelledFrames:
    rows = [f.row for f in part]
    frames = np.stack([f.pixels for f in part]) if part else np.empty((0, size, size, 3), np.uint8)
    labels = np.array([r.label for r in rows], dtype=np.int64)
    soft = soft_targets(
        [r.label for r in rows],
        [r.teacher_label for r in rows],
        [r.scores for r in rows],
        [r.human for r in rows],
        classes,
    )
    return LabelledFrames(frames, labels, soft)


@dataclass(frozen=True)
class Snapshot:
    """The recorded split: its row id, its counts, and the frames of each part."""

    snapshot_id: int
    counts: dict[str, Any]
    split_by: str
    verified: VerifiedSplit


def _ids(part: Sequence[DistinctFrame]) -> list[str]:
    return [sid for f in part for sid in f.sample_ids]


def take_snapshot(
    ctx: JobContext,
    services: PipelineServices,
    p: JobParams,
    rows: list[VerifiedRow],
    student: ServingStudent,
    reference: ReferenceSets,
) -> Snapshot:
    """Decode, fold identical frames, split, check each class's count, and record the ids."""
    classes, size = student.classes, student.frame_size
    # For the reference scenario the newest share (the drift the round answers); for a
    # fleet's own classes a split by sample id.
    split_by = "recent" if reference.kind == "scenario" else "sample-id"
    pixels = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    for i, r in enumerate(rows):
        pixels[i] = decode_frame(services.blobs.get(r.image_key), size)
        if i % 64 == 0:
            ctx.check()
    distinct = distinct_frames(rows, pixels)
    train, val, hold = split_frames(distinct, p, by=split_by)
    labels = np.array([f.row.label for f in distinct], dtype=np.int64)
    check_per_class(classes, labels, reference.training_labels(), p.min_per_class, reference.source)
    counts: dict[str, Any] = {
        "verified": len(rows),
        "distinct": len(distinct),
        "train": len(train),
        "val": len(val),
        "holdout": len(hold),
        "human_labels": sum(r.human for r in rows),
        "overridden": sum(r.human and r.label != r.teacher_label for r in rows),
    }
    with services.sessions() as session, session.begin():
        snap = DatasetSnapshot(
            job_id=ctx.job_id,
            train_ids=_ids(train),
            val_ids=_ids(val),
            holdout_ids=_ids(hold),
            counts=dict(counts),
        )
        session.add(snap)
        session.flush()
        snapshot_id = snap.id
    ctx.log(f"snapshot {snapshot_id}: {counts}; holdout split by {split_by}")
    ctx.log(
        f"classes ({len(classes)}): {', '.join(classes)}; replay and reference: {reference.source}"
    )
    n = len(classes)
    parts = VerifiedSplit(
        _labelled(train, n, size), _labelled(val, n, size), _labelled(hold, n, size)
    )
    return Snapshot(snapshot_id, counts, split_by, parts)
