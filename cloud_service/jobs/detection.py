"""One distillation job for a fleet of detectors, read top to bottom.

    snapshot -> train (warm start, replay) -> export -> INT8 -> evaluate -> gate
             -> register -> deliver

The same job as a classifier fleet's (``cloud_service.jobs.runner``), through the
detection task (``shared.tasks.detection``); the ML is ``distill.detector_distill``.

1. **Snapshot**: the fleet's verified samples with the teacher's boxes, newest first;
   a reviewer's boxes (``labels.boxes``, the newest) replace the teacher's for their
   frame. Identical frames count once. A stable hash of each frame's first sample id
   holds ``holdout_share`` of them out for the gate (a sample held out once stays held
   out); the ids are stored (``dataset_snapshots``).
2. **Replay and reference**: a labelled detection folder (``data_dir``: COCO JSON or
   YOLO, ``distill.detection_formats``) is split by a seeded permutation into replay
   frames (trained on beside the fleet's, ``replay_share`` of each epoch) and the
   reference set the gate holds the new student to; a fleet of the reference
   scenario's digits renders its scenes instead; any other fleet has neither.
3. **Train** from the serving student's checkpoint (the previous round's, else
   ``base_checkpoint``, else the one beside the serving model, else the worker's
   default; the first that is a detector), its own training settings with the round's
   learning rate (``lr`` when given, else a quarter of its own), ``epochs`` when given.
4. **Export, INT8, evaluate, gate** on mAP@0.5: new FP32, new INT8 and serving on the
   holdout, the reference set and each ``drift_eval`` drift of it.
5. **Register and deliver** the INT8 detector as for classifiers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service.db.models import Label, Sample, Verdict
from cloud_service.jobs.context import JobOutcome
from cloud_service.jobs.deliver import (
    Release,
    deliver,
    flat_metrics,
    signing_key,
    store_checkpoint,
)
from cloud_service.jobs.job import JobRun, warm_start_candidates
from cloud_service.jobs.snapshot import (
    TRAINABLE_STATUSES,
    FleetState,
    ServingStudent,
    decode_frame,
)
from cloud_service.jobs.tables import DatasetSnapshot
from distill.detection_formats import load_detection_folder
from distill.detector_cache import reference_scenario
from distill.detector_distill import DetectorGate, DetectorRound, distil_detector
from distill.detector_train import DetTrainConfig, FrameBoxes
from distill.detectors import DetectorMeta, load_detector
from distill.scenario import DIGIT_CLASSES
from distill.scenes import DetectionSet, render_scenes
from shared.errors import DataError, ModelError

__all__ = ["DetectionRow", "detection_rows", "run_detection_job"]

_REPLAY_FRAMES = 600  # labelled frames replayed against forgetting (quick: 60)
_REFERENCE_SHARE = 0.3  # of a data_dir's frames, the reference set


@dataclass(frozen=True)
class DetectionRow:
    """One verified detection sample: its frame's blob, the teacher's boxes and the
    newest reviewer's boxes (rows ``x1, y1, x2, y2, score, class``, corners as fractions)."""

    sample_id: str
    image_key: str
    teacher: list[list[float]]
    human: list[list[float]] | None


def detection_rows(session: Session, fleet: str, limit: int) -> list[DetectionRow]:
    """Verified samples of the fleet with the teacher's boxes, newest first."""
    found = session.execute(
        select(Sample.sample_id, Sample.image_key, Verdict.boxes)
        .join(Verdict, Verdict.sample_id == Sample.sample_id)
        .where(Sample.fleet == fleet, Sample.status.in_(TRAINABLE_STATUSES))
        .order_by(Verdict.verified_at.desc(), Sample.sample_id.desc())
        .limit(limit)
    ).all()
    rows = [(sid, key, boxes) for sid, key, boxes in found if boxes is not None]
    human: dict[str, list[list[float]]] = {}
    ids = [r[0] for r in rows]
    for start in range(0, len(ids), 500):
        for sid, boxes in session.execute(
            select(Label.sample_id, Label.boxes)
            .where(Label.sample_id.in_(ids[start : start + 500]))
            .order_by(Label.created_at, Label.id)
        ):
            if boxes is not None:
                human[sid] = boxes  # later rows overwrite: the newest label wins
    return [DetectionRow(sid, key, list(boxes), human.get(sid)) for sid, key, boxes in rows]


def _frame_boxes(rows: Sequence[Sequence[float]], size: int, classes: int) -> FrameBoxes:
    """Fractional rows as pixel labels at ``size``; a class outside the fleet's is dropped."""
    kept = [r for r in rows if len(r) == 6 and 0 <= int(r[5]) < classes]
    arr = np.asarray(kept, dtype=np.float32).reshape(-1, 6)
    return FrameBoxes.of(arr[:, :4] * size, arr[:, 5], arr[:, 4])


def _share(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") / 2**32


@dataclass(frozen=True)
class _Snapshot:
    snapshot_id: int
    frames: np.ndarray
    teacher: list[FrameBoxes]
    human: list[FrameBoxes | None]
    holdout: list[int]
    counts: dict[str, Any]


def _snapshot(job: JobRun, student: ServingStudent) -> _Snapshot:
    p, services, ctx = job.params, job.services, job.ctx
    with services.sessions() as session:
        rows = detection_rows(session, p.fleet, p.max_samples)
    if len(rows) < p.min_samples:
        raise DataError(
            f"only {len(rows)} verified samples with boxes for fleet {p.fleet!r}; the job"
            f" needs at least {p.min_samples} (min_samples)"
        )
    size, classes = student.frame_size, len(student.classes)
    groups: dict[str, list[int]] = {}
    pixels: list[np.ndarray] = []
    for i, row in enumerate(rows):
        frame = decode_frame(services.blobs.get(row.image_key), size)
        key = hashlib.sha256(frame.tobytes()).hexdigest()
        if key not in groups:
            pixels.append(frame)
        groups.setdefault(key, []).append(i)
        if i % 64 == 0:
            ctx.check()
    kept = list(groups.values())  # newest copy first, in the order first seen
    teacher = [_frame_boxes(rows[g[0]].teacher, size, classes) for g in kept]
    human: list[FrameBoxes | None] = []
    for g in kept:
        reviewed = next((rows[i].human for i in g if rows[i].human is not None), None)
        human.append(None if reviewed is None else _frame_boxes(reviewed, size, classes))
    first_ids = [min(rows[i].sample_id for i in g) for g in kept]
    holdout = [k for k, sid in enumerate(first_ids) if _share(sid) < p.holdout_share]
    if not holdout:
        holdout = [min(range(len(kept)), key=lambda k: _share(first_ids[k]))]
    if len(holdout) == len(kept):
        raise DataError(f"{len(kept)} distinct frames are too few to train on and hold out")
    held = set(holdout)
    ids = [[rows[i].sample_id for i in g] for g in kept]
    counts: dict[str, Any] = {
        "verified": len(rows),
        "distinct": len(kept),
        "train": len(kept) - len(held),
        "holdout": len(held),
        "human_labels": sum(h is not None for h in human),
        "teacher_boxes": sum(len(t.boxes) for t in teacher),
    }
    with services.sessions() as session, session.begin():
        snap = DatasetSnapshot(
            job_id=ctx.job_id,
            train_ids=[s for k, g in enumerate(ids) if k not in held for s in g],
            val_ids=[],
            holdout_ids=[s for k in holdout for s in ids[k]],
            counts=dict(counts),
        )
        session.add(snap)
        session.flush()
        snapshot_id = snap.id
    ctx.log(f"snapshot {snapshot_id}: {counts}; holdout split by sample-id")
    return _Snapshot(snapshot_id, np.stack(pixels), teacher, human, holdout, counts)


def _replay_and_reference(
    job: JobRun, student: ServingStudent
) -> tuple[DetectionSet | None, DetectionSet | None, str]:
    """(replay, reference, where they came from); see the module docstring."""
    p, size = job.params, student.frame_size
    limit = _REPLAY_FRAMES // 10 if p.quick else _REPLAY_FRAMES
    if p.data_dir:
        data = load_detection_folder(Path(p.data_dir), size)
        if tuple(data.class_names) != tuple(student.classes):
            raise DataError(
                f"{p.data_dir} names classes {list(data.class_names)}; the fleet's detector"
                f" answers {list(student.classes)}"
            )
        order = np.random.default_rng(p.seed).permutation(len(data))
        n_ref = max(1, round(len(data) * _REFERENCE_SHARE))
        if len(data) - n_ref < 1:
            raise DataError(f"{p.data_dir} holds {len(data)} frames: too few to replay and judge")
        reference = data.subset(np.sort(order[:n_ref]))
        replay = data.subset(np.sort(order[n_ref:][:limit]))
        return replay, reference, f"data_dir {p.data_dir}"
    scenario = reference_scenario(size)
    if tuple(DIGIT_CLASSES) != tuple(student.classes):
        return None, None, "none (a fleet of its own classes without data_dir)"
    replay = render_scenes("train", scenario)
    replay = replay.subset(np.arange(min(limit, len(replay))))
    reference = render_scenes("validation", scenario)
    return replay, reference, f"the reference scenario at {size} px"


def _serving_checkpoint(
    job: JobRun, fleet: FleetState, student: ServingStudent
) -> tuple[Path, DetectorMeta]:
    for source, path in warm_start_candidates(job, fleet, student):
        try:
            loaded = load_detector(path)
        except ModelError as exc:
            job.report.log(f"warm start: {source} skipped: {exc.message}", level="warning")
            continue
        if tuple(loaded.meta.class_names) != tuple(student.classes):
            job.report.log(f"warm start: {source} has other classes; skipped", level="warning")
            continue
        job.report.log(f"warm start from {source}")
        return path, loaded.meta
    raise ModelError(
        "no detector checkpoint of the fleet's classes to start from: give base_checkpoint,"
        " or keep the .pt that trained the serving detector beside it"
    )


def _round_config(job: JobRun, meta: DetectorMeta) -> DetTrainConfig:
    """The serving student's own training settings, with the round's changes."""
    p, given = job.params, job.ctx.params
    own = DetTrainConfig(**meta.train_config) if meta.train_config else DetTrainConfig()
    changes: dict[str, Any] = {
        "threads": p.threads,
        "replay_share": p.replay_share,
        "seed": p.seed + 1,
        "lr": p.lr if "lr" in given else own.lr * 0.25,
        "frame_size": meta.frame_size,
    }
    if "epochs" in given:
        changes["epochs"] = p.epochs
    elif p.quick:
        changes["epochs"] = min(own.epochs, 4)
    if "batch_size" in given:
        changes["batch_size"] = p.batch_size
    return replace(own, **changes)


def _thresholds(job: JobRun) -> DetectorGate:
    """The detector gate's defaults, with the job's gate parameters where given."""
    given, p = job.ctx.params, job.params
    names = ("min_gain", "max_reference_drop", "int8_tolerance", "max_drift_drop")
    return replace(DetectorGate(), **{n: getattr(p, n) for n in names if n in given})


def _metrics(
    job: JobRun, student: ServingStudent, snap: _Snapshot, result: DetectorRound, source: str
) -> dict[str, Any]:
    decision = result.decision
    return {
        "task": "detection",
        "dataset": snap.counts,
        "snapshot_id": snap.snapshot_id,
        "classes": list(student.classes),
        "reference": {"source": source, "split_by": "sample-id"},
        "train": {k: v for k, v in result.metrics["train"].items() if not isinstance(v, dict)},
        "evaluation": result.evaluation,
        "evaluation_map50_95": result.evaluation_50_95,
        "sizes": result.sizes,
        "quantization": result.metrics["quantization"],
        "gate": {"passed": decision.passed, "reasons": list(decision.reasons), **decision.checks},
        "params": dict(job.ctx.params),
    }


def run_detection_job(job: JobRun, fleet: FleetState, student: ServingStudent) -> JobOutcome:
    """Run one distillation job for a fleet of detectors (see the module docstring)."""
    report, p, ctx = job.report, job.params, job.ctx
    snap = _snapshot(job, student)
    replay, reference, source = _replay_and_reference(job, student)
    report.log(f"classes ({len(student.classes)}): {', '.join(student.classes)}; {source}")
    report.lap("snapshot")
    report.progress("train", 5)
    checkpoint, meta = _serving_checkpoint(job, fleet, student)
    config = _round_config(job, meta)
    version = f"d{ctx.job_id}.{ctx.attempt}"
    drifts = [d for d in p.drift_eval.split(",") if d.strip()] if reference is not None else []
    if reference is not None and len(reference) > p.drift_eval_frames:
        reference = reference.subset(np.arange(p.drift_eval_frames))
    ctx.check()
    result = distil_detector(
        frames=snap.frames,
        teacher=snap.teacher,
        human=snap.human,
        serving_checkpoint=checkpoint,
        serving_onnx=student.path,
        reference=reference,
        replay=replay,
        drifts=drifts,
        out_dir=job.work / "round",
        config=config,
        version=version,
        name=fleet.serving.name if fleet.serving is not None else p.model_name,
        thresholds=_thresholds(job),
        seed=p.seed,
        holdout=snap.holdout,
    )
    report.lap("train_export_evaluate")
    metrics = _metrics(job, student, snap, result, source)
    if not result.decision.passed:
        report.log(
            "gate refused the new detector: " + "; ".join(result.decision.reasons),
            level="warning",
        )
        metrics.update(report.times())
        return JobOutcome(metrics=metrics, snapshot_id=snap.snapshot_id)
    report.log(f"gate passed: {result.decision.checks}")
    report.progress("register", 94)
    signing_key(job.services)  # refused before anything is written
    metrics["checkpoint_key"] = store_checkpoint(job.services, ctx.job_id, result.checkpoint)
    release = Release(
        job_id=ctx.job_id,
        snapshot_id=snap.snapshot_id,
        artifact=result.int8,
        version=version,
        metrics=flat_metrics(result.evaluation),
        parent=fleet.serving,
    )
    delivery = deliver(job.services, p, release)
    report.log(delivery.registered)
    report.log(f"delivery: {delivery.delivered}")
    report.lap("register_deliver")
    metrics.update(registered=version, delivery=delivery.delivered, **report.times())
    report.progress("done", 100)
    return JobOutcome(metrics=metrics, result_version=version, snapshot_id=snap.snapshot_id)
