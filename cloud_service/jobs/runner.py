"""One distillation job, read top to bottom.

    snapshot -> dataset -> train (KD, warm start) -> export -> INT8 -> evaluate -> gate
             -> register -> deliver

1. **Snapshot** (``cloud_service.jobs.snapshot``): the fleet's verified samples, newest
   first, folded where frames are identical and split into train, validation and the
   holdout the gate judges on; the ids are stored (``dataset_snapshots``). The fleet's
   class set and frame size are the serving student's.
2. **Dataset** (``distill.distillation``): verified frames, class-balanced by
   oversampling, with the teacher's probabilities as soft targets (one-hot-ish where a
   human overrode the teacher), plus a *replay* share of labelled frames scored by the
   teacher, so the student does not forget: the reference scenario's training renders
   when the fleet's models carry its class set (the digits) and no ``data_dir`` is
   given; else the train split of the job's ``data_dir`` (a user's labelled folder);
   else none. The digits are never rendered for a fleet of other classes.
3. **Train**: ``distill.train.train`` with the Hinton loss
   ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(label)``, warm-started
   from the serving student's weights (the previous round's checkpoint, else
   ``base_checkpoint``, else the ``.pt`` that ``edgeloop models train`` wrote beside an
   unregistered serving model, else the worker's default; a checkpoint of another
   class set keeps its features and gets a fresh head, logged), the whole one-cycle
   schedule (early stopping on validation when ``patience`` is set), torch limited to
   the job's ``threads``; the job's cancel flag is checked after every step. Then the
   confidence is **calibrated**: a softmax temperature at which mean confidence equals
   accuracy on validation frames is folded into the last layer, so the edge's
   forwarding threshold means the same for the new student as for the old.
4. **Export** to ONNX (``distill.release``: BatchNorm folded, ONNX Runtime's offline
   graph optimisation, numeric check), then **INT8** static QDQ calibrated on recent
   verified frames plus replay frames of the clean line (never the holdout).
5. **Evaluate** new FP32, new INT8 and the serving student on the held-out samples,
   the fixed reference set (the scenario's test split, or the ``data_dir``'s test
   split; none without either), and the reference set (else the held-out samples)
   under each drift.
6. **Gate** (``distill.gate``): INT8 beats serving on the held-out samples by at least
   ``min_gain``, falls at most ``max_reference_drop`` on the reference set when there
   is one (and, with ``max_drift_drop``, under each evaluated drift), and stays within
   ``int8_tolerance`` of its own FP32. A refused model is not registered; the job
   still succeeds, with the reasons in its metrics and log.
7. **Register** the INT8 model and keep its checkpoint for the next warm start, then
   **deliver** it (``cloud_service.jobs.deliver``): promote to the fleet (retained,
   signed announcement) or start a canary rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cloud_service.jobs.context import JobContext, JobOutcome
from cloud_service.jobs.deliver import (
    Release,
    deliver,
    flat_metrics,
    signing_key,
    store_checkpoint,
)
from cloud_service.jobs.detection import run_detection_job
from cloud_service.jobs.job import JobRun, warm_start_candidates
from cloud_service.jobs.params import JobParams
from cloud_service.jobs.services import PipelineServices
from cloud_service.jobs.snapshot import (
    FleetState,
    ServingStudent,
    Snapshot,
    keep_known_classes,
    read_fleet,
    serving_student,
    take_snapshot,
)
from distill.distillation import (
    Dataset,
    ReferenceSets,
    assemble_dataset,
    calibrate_confidence,
    reference_sets,
    train_student,
    warm_start,
)
from distill.gate import GateDecision, gate
from distill.release import (
    Evaluation,
    StudentFiles,
    evaluate_student,
    export_student,
    write_checkpoint,
)
from distill.scenario import ScenarioConfig
from distill.train import TrainResult
from shared.tasks import DETECTION, task_for

__all__ = ["PipelineServices", "make_runner", "run_job"]


@dataclass(frozen=True)
class _Prepared:
    """The job's data: the fleet, its serving student, the snapshot and the dataset."""

    fleet: FleetState
    student: ServingStudent
    reference: ReferenceSets
    snapshot: Snapshot
    data: Dataset


@dataclass(frozen=True)
class _Candidate:
    """The new student: trained, calibrated, exported and evaluated."""

    version: str
    result: TrainResult
    warm_start: str
    temperature: float
    files: StudentFiles
    evaluation: Evaluation


def _prepare(job: JobRun, fleet: FleetState, student: ServingStudent) -> _Prepared:
    """Snapshot and dataset: the samples read, split and recorded; the training set built."""
    p, services, report = job.params, job.services, job.report
    rows = keep_known_classes(fleet.rows, len(student.classes), job.ctx)
    scenario = services.scenario or ScenarioConfig()
    reference = reference_sets(p.data_dir, scenario, student.classes, student.frame_size)
    snap = take_snapshot(job.ctx, services, p, rows, student, reference)
    report.lap("snapshot")

    report.progress("dataset", 3)
    teacher = Path(p.teacher_model) if p.teacher_model else services.teacher_model
    data = assemble_dataset(
        snap.verified, reference, teacher, student.classes, job.recipe, job.rng, report
    )
    snap.counts.update(
        train_frames=len(data.train), replay=len(data.replay), val_frames=len(data.val)
    )
    report.lap("dataset")
    return _Prepared(fleet, student, reference, snap, data)


def _distil(job: JobRun, prepared: _Prepared) -> _Candidate:
    """Train (warm start, candidates), calibrate, export, quantize and evaluate."""
    report, recipe, data = job.report, job.recipe, prepared.data
    classes = prepared.student.classes
    report.progress("train", 5)
    candidates = warm_start_candidates(job, prepared.fleet, prepared.student)
    start = warm_start(candidates, classes, recipe.seed)
    report.log(start.note, level="info" if start.source != "fresh" else "warning")
    version = f"d{job.ctx.job_id}.{job.ctx.attempt}"
    result = train_student(data, start, recipe, version, report)
    calibration_set = prepared.reference.calibration_set(data.val)
    temperature = calibrate_confidence(result, calibration_set, recipe, report)
    report.lap("train")

    report.progress("export", 66)
    files = export_student(result, job.work, data, classes, recipe, version, job.rng, report)
    report.lap("export_quantize")

    report.progress("evaluate", 78)
    student, reference = prepared.student.path, prepared.reference
    evaluation = evaluate_student(files, student, data.holdout, reference, recipe, job.rng, report)
    report.lap("evaluate")
    return _Candidate(version, result, start.source, temperature, files, evaluation)


def _judge(p: JobParams, candidate: _Candidate) -> GateDecision:
    return gate(
        candidate.evaluation.accuracy,
        min_gain=p.min_gain,
        max_reference_drop=p.max_reference_drop,
        int8_tolerance=p.int8_tolerance,
        sizes=candidate.evaluation.sizes,
        max_drift_drop=p.max_drift_drop,
        metric=candidate.evaluation.metric,
    )


def _metrics(
    p: JobParams, prepared: _Prepared, candidate: _Candidate, decision: GateDecision
) -> dict[str, Any]:
    snap, reference, result = prepared.snapshot, prepared.reference, candidate.result
    serving = prepared.fleet.serving
    return {
        "dataset": snap.counts,
        "snapshot_id": snap.snapshot_id,
        "classes": list(prepared.student.classes),
        "reference": {
            "kind": reference.kind,
            "source": reference.source,
            "split_by": snap.split_by,
        },
        "train": {k: v for k, v in result.metrics.items() if not isinstance(v, dict)},
        "history": result.history,
        "evaluation": candidate.evaluation.accuracy,
        "calibration": {
            "temperature": round(candidate.temperature, 4),
            "int8_frames": candidate.files.int8_frames,
        },
        "gate": {"passed": decision.passed, "reasons": list(decision.reasons), **decision.checks},
        "parent_version": None if serving is None else serving.version,
        "warm_start": candidate.warm_start,
        "params": asdict(p),
    }


def _release(
    job: JobRun, prepared: _Prepared, candidate: _Candidate, metrics: dict[str, Any]
) -> JobOutcome:
    """Keep the checkpoint, register the INT8 model and deliver it."""
    report, p, job_id = job.report, job.params, job.ctx.job_id
    report.progress("register", 94)
    signing_key(job.services)  # refused before anything is written
    student = prepared.student
    checkpoint = write_checkpoint(
        candidate.result,
        job.work / "student.pt",
        student.classes,
        student.frame_size,
        p.model_name,
        candidate.version,
    )
    metrics["checkpoint_key"] = store_checkpoint(job.services, job_id, checkpoint)
    release = Release(
        job_id=job_id,
        snapshot_id=prepared.snapshot.snapshot_id,
        artifact=candidate.files.int8,
        version=candidate.version,
        metrics=flat_metrics(candidate.evaluation.accuracy),
        parent=prepared.fleet.serving,
    )
    delivery = deliver(job.services, p, release)
    # Logged after the commit: the log is another transaction (SQLite has one writer).
    report.log(delivery.registered)
    report.log(f"delivery: {delivery.delivered}")
    report.lap("register_deliver")
    metrics.update(registered=candidate.version, delivery=delivery.delivered, **report.times())
    report.progress("done", 100)
    return JobOutcome(
        metrics=metrics, result_version=candidate.version, snapshot_id=release.snapshot_id
    )


def run_job(ctx: JobContext, services: PipelineServices) -> JobOutcome:
    """Run one distillation job (see the module docstring for the steps); a fleet of
    detectors takes ``cloud_service.jobs.detection``'s path."""
    job = JobRun.start(ctx, services)
    job.report.progress("snapshot", 1)
    fleet = read_fleet(services.sessions, job.params)
    student = serving_student(services, job.params, fleet.serving, job.work)
    if task_for(student.task) is DETECTION:
        return run_detection_job(job, fleet, student)
    prepared = _prepare(job, fleet, student)
    candidate = _distil(job, prepared)
    decision = _judge(job.params, candidate)
    metrics = _metrics(job.params, prepared, candidate, decision)
    if not decision.passed:
        job.report.log(
            "gate refused the new student: " + "; ".join(decision.reasons), level="warning"
        )
        job.report.lap("gate")
        metrics.update(job.report.times())
        return JobOutcome(metrics=metrics, snapshot_id=prepared.snapshot.snapshot_id)
    job.report.log(f"gate passed: {decision.checks}")
    return _release(job, prepared, candidate, metrics)


def make_runner(services: PipelineServices) -> Callable[[JobContext], JobOutcome]:
    """The worker's runner: ``DistillWorker(sessions, runner=make_runner(services))``."""

    def runner(ctx: JobContext) -> JobOutcome:
        return run_job(ctx, services)

    return runner
