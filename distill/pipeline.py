"""One distillation job, read top to bottom.

    snapshot -> dataset -> train (KD, warm start) -> export -> INT8 -> evaluate -> gate
             -> register -> deliver

1. **Snapshot**: the verified samples (teacher verdict; a human label overrides the
   teacher's), newest first. The fleet's class set and frame size are the serving
   student's. The held-out share the gate judges on is, for the reference scenario,
   the newest ``holdout_share`` (the drift the round answers); for a fleet of its own
   classes, a stable hash of the sample id picks it, so a sample held out once stays
   held out in later rounds. A seeded ``val_share`` of the rest is for early stopping,
   the remainder trains. Identical frames (a static camera sends the same picture
   again) count once and stay on one side of the split. Each class needs
   ``min_per_class`` labelled frames. The ids are stored (``dataset_snapshots``), so a
   model version can be traced to the exact samples it saw.
2. **Dataset**: verified frames, class-balanced by oversampling, with the teacher's
   probabilities as soft targets (one-hot-ish where a human overrode the teacher),
   plus a *replay* share of labelled frames scored by the teacher, so the student does
   not forget: the reference scenario's training renders when the fleet's models carry
   its class set (the digits) and no ``data_dir`` is given; else the train split of the
   job's ``data_dir`` (a user's labelled folder); else none. The digits are never
   rendered for a fleet of other classes.
3. **Train**: ``distill.train.train`` with the Hinton loss
   ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(label)``, warm-started
   from the serving student's weights (the previous round's checkpoint, else
   ``base_checkpoint``, else the ``.pt`` that ``edgeloop models train`` wrote beside an
   unregistered serving model, else the worker's default; a checkpoint of another
   class set keeps its features and gets a fresh head, logged),
   the whole one-cycle schedule (early stopping on validation when ``patience`` is
   set), torch limited to the job's ``threads``; the job's cancel flag is checked after
   every step. Then the confidence is **calibrated**: a softmax temperature at which
   mean confidence equals accuracy on validation frames is folded into the last layer,
   so the edge's forwarding threshold means the same for the new student as for the old.
4. **Export** to ONNX (BatchNorm folded, ONNX Runtime's offline graph optimisation,
   numeric check), then **INT8** static QDQ calibrated on recent verified frames
   plus replay frames of the clean line (never the holdout the gate judges on).
5. **Evaluate** new FP32, new INT8 and the serving student on the held-out samples,
   the fixed reference set (the scenario's test split, or the ``data_dir``'s test
   split; none without either), and the reference set (else the held-out samples)
   under each drift.
6. **Gate**: INT8 beats serving on the held-out samples by at least ``min_gain``, falls
   at most ``max_reference_drop`` on the reference set when there is one (and, with
   ``max_drift_drop``, under each evaluated drift), and stays within ``int8_tolerance``
   of its own FP32. A refused model is not registered; the job
   still succeeds, with the reasons in its metrics and log.
7. **Register** the INT8 model (lineage: job, snapshot, parent version; the metrics),
   keep its checkpoint for the next warm start, and **deliver** it: promote to the
   fleet (retained, signed announcement) or start a canary rollout.
"""

from __future__ import annotations

import hashlib
import io
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy import select
from sqlalchemy.orm import Session

from cloud_service import registry
from cloud_service.announce import Announcer
from cloud_service.blobs import BlobStore
from cloud_service.db.models import FleetModel, Label, ModelVersion, Sample, Verdict
from distill.frames import FrameSet
from distill.store import DatasetSnapshot, DistillJob
from distill.worker import JobContext, JobOutcome
from shared.errors import DataError, ModelError
from shared.manifest import FleetSigningKey
from shared.topics import Topics

__all__ = [
    "GateDecision",
    "JobParams",
    "PipelineServices",
    "gate",
    "make_runner",
    "run_job",
]

TRAINABLE_STATUSES: tuple[str, ...] = ("verified", "reviewed", "flagged")


@dataclass(frozen=True)
class JobParams:
    """A job's knobs (``distill.jobs.validate_params`` checks what users send)."""

    fleet: str = "default"
    model_name: str = "edgeloop-student"
    epochs: int = 10
    lr: float = 5e-4
    batch_size: int = 64
    temperature: float = 4.0
    alpha: float = 0.7
    # Unset, the whole one-cycle schedule runs and its last, annealed weights are kept:
    # judged on a validation split of a few dozen verified frames, the "best" epoch was
    # often the first, an under-trained student.
    patience: int | None = None
    max_samples: int = 5000
    min_samples: int = 50
    replay_share: float = 0.6
    holdout_share: float = 0.2
    val_share: float = 0.15
    min_gain: float = 0.0
    max_reference_drop: float = 0.02
    # When set, the new INT8 may fall at most this much under each evaluated drift too
    # (the reference set rendered with ``drift_eval``); unset, drifts are reported only.
    max_drift_drop: float | None = None
    int8_tolerance: float = 0.02
    threads: int = 1
    wall_time_s: float = 3600.0
    delivery: str = "promote"
    canary_percent: float = 25.0
    drift_eval: str = "background:1,rotation:1,lighting:1,blur:1,noise:1,jpeg:1"
    drift_eval_frames: int = 300
    base_checkpoint: str = ""
    serving_model: str = ""
    teacher_model: str = ""
    quick: bool = False
    seed: int = 0
    calibration_frames: int = 256
    calibrate_confidence: bool = True
    # Random shifts of training frames, up to this many pixels: a generic augmentation
    # that makes a few hundred verified frames go further (the closed loop's drifted
    # accuracy and its clean accuracy both rose with it; 0 turns it off).
    shift_px: int = 4
    # Training runs with seeds seed, seed+1, ...; the lowest validation NLL is kept.
    candidates: int = 1
    # A labelled folder (ImageFolder, COCO JSON or YOLO; see distill.datasets) of the
    # fleet's classes: its train split is replayed, its validation split watched, and its
    # test split is the reference set the gate holds the new student to.
    data_dir: str = ""
    # Each of the fleet's classes needs this many labelled frames (samples and data_dir).
    min_per_class: int = 5

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> JobParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in known})


@dataclass
class PipelineServices:
    """What the job needs from its surroundings (the worker process builds these once)."""

    sessions: Callable[[], Session]  # a sessionmaker: ``with services.sessions.begin()``
    blobs: BlobStore
    work_dir: Path
    signing_key: FleetSigningKey | None = None
    announcer: Announcer | None = None
    topics: Topics | None = None
    # Fallbacks when the fleet serves nothing registered yet: the reference models.
    base_checkpoint: Path | None = None
    serving_model: Path | None = None
    teacher_model: Path | None = None
    scenario: Any = None  # distill.scenario.ScenarioConfig; the reference one when None
    console_progress: Callable[[int, str, float], None] | None = None


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: tuple[str, ...]
    checks: dict[str, Any]


def gate(
    evaluation: dict[str, dict[str, float]],
    *,
    min_gain: float,
    max_reference_drop: float,
    int8_tolerance: float,
    sizes: Mapping[str, int] | None = None,
    max_drift_drop: float | None = None,
) -> GateDecision:
    """The release rule. ``evaluation[model][dataset]`` = accuracy; models new_fp32,
    new_int8, serving; datasets holdout and (when there is a reference set) reference.

    ``sizes`` (frames per dataset) makes the INT8 check count what is evidence: the
    recent holdout is a few dozen of the frames the student was least sure of, where
    quantization flips a frame or two by chance. With ``c`` frames of difference on
    ``n``, the gap counted is the lower bound ``(c - 2 sqrt(c)) / n`` (two Poisson
    standard errors); 2 of 83 frames counts as 0, 8 of 83 as 2.8 points.

    ``max_drift_drop`` also holds the new INT8 to the serving student on every
    ``drift:...`` dataset: a round that fits the recent frames but falls on unseen
    scans under the very drift it answers is refused.
    """
    new, fp32, old = evaluation["new_int8"], evaluation["new_fp32"], evaluation["serving"]
    gain = new["holdout"] - old["holdout"]
    # A fleet of its own classes with no labelled folder has no reference set to hold to.
    has_reference = "reference" in new and "reference" in old
    ref_drop = old["reference"] - new["reference"] if has_reference else 0.0
    gaps = {d: abs(fp32[d] - new[d]) for d in ("holdout", "reference") if d in new and d in fp32}
    int8_gap = max(
        _gap_lower_bound(gap, sizes[d]) if sizes and sizes.get(d) else gap
        for d, gap in gaps.items()
    )
    reasons = []
    if not gain > min_gain:
        reasons.append(
            f"no better on recent data: INT8 {new['holdout']:.3f} vs serving"
            f" {old['holdout']:.3f} (needs a gain above {min_gain:+.3f})"
        )
    if has_reference and ref_drop > max_reference_drop:
        reasons.append(
            f"falls on the reference set: {new['reference']:.3f} vs serving"
            f" {old['reference']:.3f} (at most {max_reference_drop:.3f} lower allowed)"
        )
    drift_drops = {d: old[d] - new[d] for d in new if d.startswith("drift:") and d in old}
    if max_drift_drop is not None:
        for d, drop in drift_drops.items():
            if drop > max_drift_drop:
                reasons.append(
                    f"falls under {d.removeprefix('drift:')}: {new[d]:.3f} vs serving"
                    f" {old[d]:.3f} (at most {max_drift_drop:.3f} lower allowed)"
                )
    if int8_gap > int8_tolerance:
        worst = max(gaps, key=lambda d: gaps[d])
        reasons.append(
            f"INT8 is {int8_gap:.3f} from its FP32 (tolerance {int8_tolerance:.3f};"
            f" {gaps[worst]:.3f} on {worst} as measured)"
        )
    checks = {
        "holdout_gain": round(gain, 4),
        "reference_drop": round(ref_drop, 4) if has_reference else None,
        "int8_gap": round(int8_gap, 4),
        "int8_gap_raw": {d: round(g, 4) for d, g in gaps.items()},
        "min_gain": min_gain,
        "max_reference_drop": max_reference_drop,
        "int8_tolerance": int8_tolerance,
        "drift_drop": {d: round(v, 4) for d, v in drift_drops.items()},
        "max_drift_drop": max_drift_drop,
    }
    return GateDecision(passed=not reasons, reasons=tuple(reasons), checks=checks)


def _gap_lower_bound(gap: float, n: int) -> float:
    """An accuracy gap on ``n`` frames less two Poisson standard errors of its frame count."""
    count = round(gap * n)
    return max(0.0, (count - 2.0 * math.sqrt(count)) / n)


# ---------------------------------------------------------------------------------
# Pieces


@dataclass
class _Row:
    sample_id: str
    image_key: str
    label: int
    teacher_label: int
    scores: list[float]
    human: bool


def _step_reporter(
    progress: Callable[[str, float], None], offset: float, share: float
) -> Callable[[int, int], None]:
    """Training steps as the ``share`` of the job's percent that starts at ``offset``."""

    def report(step: int, total: int) -> None:
        progress("train", offset + share * step / max(1, total))

    return report


def _decode(data: bytes, size: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8)


def _verified_rows(session: Session, fleet: str, limit: int) -> list[_Row]:
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
        _Row(
            sample_id=sid,
            image_key=key,
            label=human.get(sid, int(tlabel)),
            teacher_label=int(tlabel),
            scores=[float(x) for x in scores],
            human=sid in human,
        )
        for sid, key, tlabel, scores in pairs
    ]


@dataclass(frozen=True)
class _Frame:
    """One distinct picture among the verified samples. A static camera sends the same
    frame again; its copies count once and stay on one side of every split, or the
    holdout the gate judges on would hold frames the new student trained on."""

    row: _Row  # the newest copy, with the newest human label of any copy
    sample_ids: tuple[str, ...]
    pixels: np.ndarray
    key: str


def _distinct(rows: Sequence[_Row], pixels: np.ndarray) -> list[_Frame]:
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
        out.append(_Frame(newest, ids, pixels[members[0]], key))
    return out


def _split(
    frames: list[_Frame], p: JobParams, *, by: str = "recent"
) -> tuple[list[_Frame], list[_Frame], list[_Frame]]:
    """(train, val, holdout). ``by="recent"``: the newest share is the holdout;
    ``by="sample-id"``: a stable hash of each picture's first sample id picks it, so a
    sample held out once stays held out in every later round. Val by a stable hash."""

    def share(f: _Frame, salt: str) -> float:
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

    def in_val(f: _Frame) -> bool:
        return share(f, str(p.seed)) < p.val_share

    val = [f for f in rest if in_val(f)]
    train = [f for f in rest if not in_val(f)]
    return train, val, holdout


def _soft(rows: Sequence[_Row], classes: int) -> np.ndarray:
    """Teacher probabilities; where a human overrode the teacher, a smoothed one-hot."""
    out = np.zeros((len(rows), classes), dtype=np.float32)
    for i, r in enumerate(rows):
        if (r.human and r.label != r.teacher_label) or len(r.scores) != classes:
            out[i] = 0.05 / classes
            out[i, r.label] += 0.95
        else:
            out[i] = np.asarray(r.scores, dtype=np.float32)
    return out / out.sum(axis=1, keepdims=True)


def _frameset(
    frames: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], tag: str
) -> FrameSet:
    return FrameSet(
        frames=frames.astype(np.uint8, copy=False),
        labels=labels.astype(np.int64, copy=False),
        class_names=classes,
        identity=tag,
    )


def _balance(labels: np.ndarray, rng: np.random.Generator, classes: int) -> np.ndarray:
    """Indices that oversample each present class up to the largest class's count."""
    present = [c for c in range(classes) if (labels == c).any()]
    if not present:
        return np.arange(len(labels))
    target = max(int((labels == c).sum()) for c in present)
    picks = []
    for c in present:
        members = np.flatnonzero(labels == c)
        extra = rng.choice(members, target - len(members), replace=True)
        picks.append(np.concatenate([members, extra]))
    return np.sort(np.concatenate(picks))


def _calibration_frames(
    recent: np.ndarray,
    val: np.ndarray,
    replay: np.ndarray,
    limit: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """INT8 calibration frames: half recent verified frames, half replay of the clean line.

    Activation ranges must cover both what the fleet sees now and what it saw before,
    or the INT8 model forgets in quantization what training kept.
    """
    fresh = np.concatenate([recent, val]) if len(val) else recent
    n_fresh = min(len(fresh), max(limit - min(len(replay), limit // 2), limit // 2))
    n_replay = min(len(replay), limit - n_fresh)
    picks = [fresh[np.sort(rng.choice(len(fresh), n_fresh, replace=False))]]
    if n_replay:
        picks.append(replay[np.sort(rng.choice(len(replay), n_replay, replace=False))])
    return np.concatenate(picks)


def _serving(session: Session, fleet: str) -> ModelVersion | None:
    current = session.get(FleetModel, fleet)
    if current is None:
        return None
    return session.scalars(
        select(ModelVersion).where(
            ModelVersion.name == current.model_name, ModelVersion.version == current.version
        )
    ).first()


def _blob_to_file(blobs: BlobStore, key: str, path: Path) -> Path:
    local = registry.artifact_path(blobs, key)
    if local is not None and local.is_file():
        return local
    path.write_bytes(blobs.get(key))
    return path


def _checkpoint_key(job_id: int) -> str:
    return f"distill/jobs/{job_id}/student.pt"


def _resolve_serving(
    services: PipelineServices, p: JobParams, serving_info: tuple[str, str, str] | None, work: Path
) -> Path:
    if serving_info is not None:
        return _blob_to_file(services.blobs, serving_info[2], work / "serving.onnx")
    if p.serving_model:
        return Path(p.serving_model)
    if services.serving_model is not None:
        return services.serving_model
    raise ModelError("no serving student to compare with (serving_model)")


@dataclass(frozen=True)
class _Reference:
    """Labelled frames beside the fleet's samples: replayed in training (``replay``),
    watched for early stopping and confidence calibration (``val``), and the fixed set
    the gate holds the new student to (``test``). From the reference scenario's renders
    when the fleet runs it, else from the job's ``data_dir``, else none."""

    kind: str  # "scenario", "folder" or "none"
    source: str
    replay: FrameSet | None = None
    val: FrameSet | None = None
    test: FrameSet | None = None


def _runs_reference_scenario(classes: Sequence[str], size: int, scenario: Any) -> bool:
    """The fleet's models carry the reference scenario's class set at its frame size."""
    from distill.scenario import DIGIT_CLASSES

    return tuple(classes) == DIGIT_CLASSES and size == scenario.frame_size


def _folder_split(root: str, split: str, classes: tuple[str, ...], size: int) -> FrameSet | None:
    """One split of a labelled folder, its labels as indices into the fleet's classes;
    None when no file of the folder falls into that split."""
    from distill.datasets import load_data
    from distill.evaluate import align_labels

    try:
        loaded = load_data(root, split=split, frame_size=size).frames
    except DataError as exc:
        if "no readable images in split" in exc.message:
            return None
        raise
    try:
        labels = align_labels(loaded, classes)
    except DataError as exc:
        raise DataError(f"data_dir {root}: {exc.message}") from exc
    keep = labels >= 0
    return _frameset(loaded.frames[keep], labels[keep], classes, f"{loaded.identity}")


def _reference_sets(p: JobParams, scenario: Any, classes: tuple[str, ...], size: int) -> _Reference:
    if p.data_dir:
        parts = {s: _folder_split(p.data_dir, s, classes, size) for s in _FOLDER_PARTS}
        return _Reference(
            "folder",
            f"data_dir {p.data_dir}",
            replay=parts["train"],
            val=parts["validation"],
            test=parts["test"],
        )
    if _runs_reference_scenario(classes, size, scenario):
        from distill.scenario import render_split

        return _Reference(
            "scenario",
            "the reference scenario",
            replay=render_split("train", scenario),
            val=render_split("validation", scenario),
            test=render_split("test", scenario),
        )
    return _Reference("none", "no reference set (the fleet's own samples only)")


_FOLDER_PARTS = ("train", "validation", "test")


def _check_per_class(
    classes: tuple[str, ...], fleet: np.ndarray, extra: np.ndarray, need: int, source: str
) -> None:
    """DataError naming every class with fewer than ``need`` labelled frames."""
    n = len(classes)
    have = np.bincount(fleet, minlength=n)[:n] + np.bincount(extra, minlength=n)[:n]
    short = [c for c, k in zip(classes, have, strict=True) if k < need]
    if short:
        listed = ", ".join(f"{c} {int(k)}" for c, k in zip(classes, have, strict=True))
        raise DataError(
            f"too few labelled frames for class(es) {', '.join(short)}: each class needs at"
            f" least {need} (min_per_class); have {listed} (verified samples"
            + (f" and {source}" if len(extra) else "")
            + ")"
        )


def _checkpoint_beside(model: Path) -> Path:
    """The checkpoint ``models train`` wrote beside a model: NAME.pt for NAME.onnx, and
    for the NAME.int8.onnx that ``models quantize`` made of it."""
    stem = model.name.removesuffix(".onnx").removesuffix(".int8")
    return model.with_name(f"{stem}.pt")


@dataclass(frozen=True)
class _WarmStart:
    state: dict[str, Any]
    arch: str
    width: float
    source: str
    note: str


def _warm_start(
    candidates: Sequence[tuple[str, Path]],
    classes: tuple[str, ...],
    seed: int,
) -> _WarmStart:
    """Weights to start from: the first ``(what, path)`` checkpoint that exists, with a
    fresh head when its class set is not the fleet's; a fresh student when there is none."""
    import torch

    from distill.models import build_model, load_checkpoint, transfer_weights

    found = next(((what, c) for what, c in candidates if c.is_file()), None)
    torch.manual_seed(seed)
    if found is None:
        net = build_model("student-cnn", len(classes))
        return _WarmStart(
            net.state_dict(),
            "student-cnn",
            1.0,
            "fresh",
            "no student checkpoint to warm-start from (base_checkpoint): training a fresh"
            " student-cnn",
        )
    what, path = found
    base = load_checkpoint(path)
    if tuple(base.meta.class_names) == classes:
        return _WarmStart(
            base.net.state_dict(),
            base.meta.arch,
            base.meta.width,
            what,
            f"warm start from {what} ({base.meta.name} {base.meta.version})",
        )
    net = build_model(base.meta.arch, len(classes), base.meta.width)
    fresh = transfer_weights(net, base.net.state_dict())
    return _WarmStart(
        net.state_dict(),
        base.meta.arch,
        base.meta.width,
        what,
        f"warm start from {what}: its {base.meta.num_classes} classes"
        f" ({', '.join(base.meta.class_names)}) are not the fleet's {len(classes)}"
        f" ({', '.join(classes)}); kept its features, re-initialised {', '.join(fresh)}",
    )


# ---------------------------------------------------------------------------------
# The job


def run_job(ctx: JobContext, services: PipelineServices) -> JobOutcome:
    """Run one distillation job (see the module docstring for the steps)."""
    from distill.drift import parse_drift_spec
    from distill.evaluate import OnnxClassifier, evaluate
    from distill.export import export_onnx, read_onnx_info
    from distill.models import ModelMeta, save_checkpoint
    from distill.quantize import quantize_onnx
    from distill.scenario import ScenarioConfig
    from distill.train import (
        TrainConfig,
        TrainResult,
        fit_temperature,
        fold_temperature,
        random_shift,
        train,
        validation_nll,
    )

    p = JobParams.from_dict(ctx.params)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - mark[0], 2)
        mark[0] = now

    def progress(phase: str, percent: float) -> None:
        ctx.progress(phase, percent)
        if services.console_progress is not None:
            services.console_progress(ctx.job_id, phase, percent)

    work = Path(tempfile.mkdtemp(prefix=f"job-{ctx.job_id}-", dir=services.work_dir))
    scenario = services.scenario or ScenarioConfig()
    rng = np.random.default_rng([p.seed, ctx.job_id])

    # -- snapshot ------------------------------------------------------------------
    progress("snapshot", 1)
    with services.sessions() as session:
        rows = _verified_rows(session, p.fleet, p.max_samples)
        serving = _serving(session, p.fleet)
        serving_info = (
            None if serving is None else (serving.name, serving.version, serving.artifact_key)
        )
        parent_job = (
            None
            if serving is None
            else session.scalars(
                select(DistillJob).where(DistillJob.result_version == serving.version)
            ).first()
        )
        parent_ckpt = None if parent_job is None else parent_job.metrics.get("checkpoint_key")
        parent_job_id = None if parent_job is None else parent_job.id
    if len(rows) < p.min_samples:
        raise DataError(
            f"only {len(rows)} verified samples for fleet {p.fleet!r}; the job needs"
            f" at least {p.min_samples} (min_samples)"
        )
    # The fleet's class set and frame size are the serving student's: every sample's
    # label indexes into them, and the new student must answer with the same classes.
    serving_path = _resolve_serving(services, p, serving_info, work)
    serving_meta = read_onnx_info(serving_path)
    classes, size = serving_meta.labels, serving_meta.frame_size
    n_cls = len(classes)
    outside = [r for r in rows if not 0 <= r.label < n_cls]
    if outside:
        ctx.log(
            f"{len(outside)} sample(s) labelled outside the fleet's {n_cls} classes left out",
            level="warning",
        )
        rows = [r for r in rows if 0 <= r.label < n_cls]
    reference = _reference_sets(p, scenario, classes, size)
    # Which frames the gate judges: for the reference scenario the newest share (the
    # drift the round answers); for a fleet's own classes a split by sample id, so a
    # sample held out once stays held out in every later round.
    split_by = "recent" if reference.kind == "scenario" else "sample-id"
    pixels = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    for i, r in enumerate(rows):
        pixels[i] = _decode(services.blobs.get(r.image_key), size)
        if i % 64 == 0:
            ctx.check()
    distinct = _distinct(rows, pixels)
    train_frames, val_frames, hold_frames = _split(distinct, p, by=split_by)
    extra_labels = np.concatenate(
        [s.labels for s in (reference.replay, reference.val) if s is not None]
        or [np.empty(0, np.int64)]
    )
    _check_per_class(
        classes,
        np.array([f.row.label for f in distinct], dtype=np.int64),
        extra_labels,
        p.min_per_class,
        reference.source,
    )
    counts = {
        "verified": len(rows),
        "distinct": len(distinct),
        "train": len(train_frames),
        "val": len(val_frames),
        "holdout": len(hold_frames),
        "human_labels": sum(r.human for r in rows),
        "overridden": sum(r.human and r.label != r.teacher_label for r in rows),
    }

    def ids(part: Sequence[_Frame]) -> list[str]:
        return [sid for f in part for sid in f.sample_ids]

    with services.sessions() as session, session.begin():
        snap = DatasetSnapshot(
            job_id=ctx.job_id,
            train_ids=ids(train_frames),
            val_ids=ids(val_frames),
            holdout_ids=ids(hold_frames),
            counts=counts,
        )
        session.add(snap)
        session.flush()
        snapshot_id = snap.id
    ctx.log(f"snapshot {snapshot_id}: {counts}; holdout split by {split_by}")
    ctx.log(f"classes ({n_cls}): {', '.join(classes)}; replay and reference: {reference.source}")
    lap("snapshot")

    # -- dataset -------------------------------------------------------------------
    progress("dataset", 3)

    def load(part: Sequence[_Frame]) -> tuple[np.ndarray, np.ndarray]:
        x = np.stack([f.pixels for f in part]) if part else np.empty((0, size, size, 3), np.uint8)
        return x, np.array([f.row.label for f in part], dtype=np.int64)

    x_ver, y_ver = load(train_frames)
    s_ver = _soft([f.row for f in train_frames], n_cls)
    x_recent = x_ver  # the verified training frames as they arrived (before balancing)
    x_val, y_val = load(val_frames)
    x_hold, y_hold = load(hold_frames)
    keep = _balance(y_ver, rng, n_cls)
    x_ver, y_ver, s_ver = x_ver[keep], y_ver[keep], s_ver[keep]

    teacher_path = Path(p.teacher_model) if p.teacher_model else services.teacher_model
    teacher = None
    if teacher_path is not None:
        teacher = OnnxClassifier(teacher_path, threads=p.threads)
        if tuple(teacher.class_names) != classes:
            ctx.log(
                f"teacher {teacher_path.name} has other classes"
                f" ({', '.join(teacher.class_names)}): replay frames keep their own labels",
                level="warning",
            )
            teacher = None
    replay_pool = reference.replay
    n_replay = 0
    if replay_pool is not None and len(replay_pool):
        n_replay = round(len(x_ver) * p.replay_share / max(1e-6, 1.0 - p.replay_share))
        n_replay = min(n_replay, len(replay_pool))
    replay_idx = (
        np.sort(rng.choice(len(replay_pool), n_replay, replace=False))
        if replay_pool is not None and n_replay
        else np.empty(0, np.int64)
    )
    x_rep = (
        replay_pool.frames[replay_idx]
        if replay_pool is not None
        else np.empty((0, size, size, 3), np.uint8)
    )
    y_rep = replay_pool.labels[replay_idx] if replay_pool is not None else np.empty(0, np.int64)
    if teacher is not None and n_replay:
        s_rep = teacher.scores(x_rep).astype(np.float32)
    else:
        s_rep = np.full((n_replay, n_cls), 0.05 / n_cls, dtype=np.float32)
        s_rep[np.arange(n_replay), y_rep] += 0.95
    train_set = _frameset(
        np.concatenate([x_ver, x_rep]), np.concatenate([y_ver, y_rep]), classes, "job-train"
    )
    soft = np.concatenate([s_ver, s_rep]).astype(np.float32)
    # Early stopping watches verified validation frames and as many reference ones, so
    # it stops neither on drift alone nor on the clean line alone.
    ref_val = reference.val
    x_val_all, y_val_all = x_val, y_val
    if ref_val is not None and len(ref_val):
        n_ref_val = min(len(ref_val), max(len(x_val), 50))
        ref_val_idx = np.sort(rng.choice(len(ref_val), n_ref_val, replace=False))
        x_val_all = np.concatenate([x_val, ref_val.frames[ref_val_idx]])
        y_val_all = np.concatenate([y_val, ref_val.labels[ref_val_idx]])
    val_set = _frameset(x_val_all, y_val_all, classes, "job-val")
    holdout = _frameset(x_hold, y_hold, classes, "job-holdout")
    counts.update(train_frames=len(train_set), replay=n_replay, val_frames=len(val_set))
    ctx.log(
        f"dataset: {len(x_ver)} verified (class-balanced) + {n_replay} replay frames,"
        f" {len(val_set)} validation, {len(holdout)} held out"
    )
    lap("dataset")

    # -- train ---------------------------------------------------------------------
    progress("train", 5)
    ckpt_candidates: list[tuple[str, Path]] = []
    if parent_ckpt and services.blobs.exists(str(parent_ckpt)):
        parent_path = _blob_to_file(services.blobs, str(parent_ckpt), work / "parent.pt")
        ckpt_candidates.append((f"the serving student (job {parent_job_id})", parent_path))
    if p.base_checkpoint:
        ckpt_candidates.append((f"base_checkpoint {p.base_checkpoint}", Path(p.base_checkpoint)))
    if serving_info is None:
        beside = _checkpoint_beside(serving_path)
        ckpt_candidates.append((f"{beside} (beside the serving student)", beside))
    if services.base_checkpoint is not None:
        ckpt_candidates.append((f"{services.base_checkpoint}", services.base_checkpoint))
    start = _warm_start(ckpt_candidates, classes, p.seed)
    ctx.log(start.note, level="info" if start.source != "fresh" else "warning")
    version = f"d{ctx.job_id}.{ctx.attempt}"
    candidates: list[tuple[float, TrainResult]] = []
    for c in range(p.candidates):
        cfg = TrainConfig.for_role(
            "student",
            arch=start.arch,
            width=start.width,
            epochs=p.epochs,
            lr=p.lr,
            batch_size=p.batch_size,
            temperature=p.temperature,
            alpha=p.alpha,
            threads=p.threads,
            seed=p.seed + c,
            frame_size=size,
        )
        share, offset = 60 / p.candidates, 5 + 60 * c / p.candidates
        trained = train(
            cfg,
            train_set,
            val_set if len(val_set) else None,
            soft_targets=soft,
            name=p.model_name,
            version=version,
            progress=False,
            init_state=start.state,
            on_step=_step_reporter(progress, offset, share),
            patience=p.patience,
            keep_last=p.patience is None,
            augment=(
                None
                if p.shift_px <= 0
                else lambda frames, g: random_shift(frames, g, max_px=p.shift_px)
            ),
        )
        val_nll = validation_nll(trained.net, val_set.frames, val_set.labels)
        candidates.append((val_nll, trained))
        if p.candidates > 1:
            ctx.log(f"candidate {c + 1}/{p.candidates} (seed {p.seed + c}): val NLL {val_nll:.4f}")
    # Several seeds, the lowest validation NLL wins: one run's luck moves a few hundred
    # frames' student by a point; the gate still judges the winner on the holdout.
    val_nll, result = min(candidates, key=lambda pair: pair[0])
    result.metrics["val_nll"] = round(val_nll, 5)
    result.metrics["candidates_val_nll"] = [round(n, 5) for n, _ in candidates]
    result.metrics["seed"] = result.config.seed
    ctx.log(
        f"trained from {start.source}: best epoch"
        f" {result.metrics['best_epoch']} of {len(result.history)},"
        f" val {result.metrics.get('val_acc', float('nan')):.3f}"
    )
    # -- calibrate the confidence --------------------------------------------------
    # The edge forwards a frame when its confidence is below a threshold; temperature
    # scaling makes that threshold mean the same for every student: on validation
    # frames (the reference scenario's whole validation split; else the job's), mean
    # confidence equals accuracy.
    temperature = 1.0
    calib_val = ref_val if reference.kind == "scenario" and ref_val is not None else val_set
    if p.calibrate_confidence and len(calib_val):
        temperature = fit_temperature(result.net, calib_val.frames, calib_val.labels)
        fold_temperature(result.net, temperature)
        ctx.log(
            f"confidence calibrated on {len(calib_val)} validation frames: T = {temperature:.3f}"
        )
    lap("train")

    # -- export, optimise, INT8 ----------------------------------------------------
    progress("export", 66)
    fp32_path, int8_path = work / "student.onnx", work / "student.int8.onnx"
    export = export_onnx(
        result.net,
        fp32_path,
        class_names=classes,
        frame_size=size,
        name=p.model_name,
        version=version,
        check_frames=x_hold,
    )
    ctx.log(
        f"exported: {export.nodes_unoptimized} -> {export.nodes_final} nodes after optimisation"
    )
    progress("quantize", 72)
    calib = _calibration_frames(x_recent, x_val, x_rep, p.calibration_frames, rng)
    quant = quantize_onnx(fp32_path, int8_path, calib)
    ctx.log(
        f"INT8: {quant.size_bytes} bytes, calibrated on {len(calib)} frames"
        " (recent verified and replay; the holdout is kept out)"
    )
    lap("export_quantize")

    # -- evaluate ------------------------------------------------------------------
    progress("evaluate", 78)
    models = {
        "new_fp32": OnnxClassifier(fp32_path, threads=p.threads),
        "new_int8": OnnxClassifier(int8_path, threads=p.threads),
        "serving": OnnxClassifier(serving_path, threads=p.threads),
    }
    eval_sets: dict[str, tuple[FrameSet, tuple[Any, ...]]] = {"holdout": (holdout, ())}
    sizes = {"holdout": len(holdout)}
    ref_test = reference.test
    if ref_test is not None and len(ref_test):
        eval_sets["reference"] = (ref_test, ())
        sizes["reference"] = len(ref_test)
    drift_base = ref_test if ref_test is not None and len(ref_test) else holdout
    n_eval = min(len(drift_base), p.drift_eval_frames)
    drift_small = drift_base.subset(np.sort(rng.choice(len(drift_base), n_eval, replace=False)))
    for drift in parse_drift_spec(p.drift_eval):
        eval_sets[f"drift:{drift}"] = (drift_small, (drift,))
    evaluation: dict[str, dict[str, float]] = {m: {} for m in models}
    for i, (dname, (data, spec)) in enumerate(eval_sets.items()):
        for mname, clf in models.items():
            evaluation[mname][dname] = round(evaluate(clf, data, drift=spec, seed=1).accuracy, 4)
        progress("evaluate", 78 + 14 * (i + 1) / len(eval_sets))
    ctx.log(
        f"evaluated on {len(holdout)} held-out samples"
        + (
            f" and {sizes['reference']} reference frames ({reference.source})"
            if "reference" in sizes
            else ""
        )
    )
    lap("evaluate")

    # -- gate ----------------------------------------------------------------------
    decision = gate(
        evaluation,
        min_gain=p.min_gain,
        max_reference_drop=p.max_reference_drop,
        int8_tolerance=p.int8_tolerance,
        sizes=sizes,
        max_drift_drop=p.max_drift_drop,
    )
    metrics: dict[str, Any] = {
        "dataset": counts,
        "snapshot_id": snapshot_id,
        "classes": list(classes),
        "reference": {"kind": reference.kind, "source": reference.source, "split_by": split_by},
        "train": {k: v for k, v in result.metrics.items() if not isinstance(v, dict)},
        "history": result.history,
        "evaluation": evaluation,
        "calibration": {"temperature": round(temperature, 4), "int8_frames": len(calib)},
        "gate": {"passed": decision.passed, "reasons": list(decision.reasons), **decision.checks},
        "parent_version": None if serving_info is None else serving_info[1],
        "warm_start": start.source,
        "params": asdict(p),
    }
    if not decision.passed:
        ctx.log("gate refused the new student: " + "; ".join(decision.reasons), level="warning")
        lap("gate")
        metrics.update(timings=timings, wall_s=round(time.perf_counter() - started, 2))
        return JobOutcome(metrics=metrics, snapshot_id=snapshot_id)
    ctx.log(f"gate passed: {decision.checks}")

    # -- register ------------------------------------------------------------------
    progress("register", 94)
    if services.signing_key is None:
        raise ModelError("the worker has no fleet signing key; cannot register")
    ckpt = work / "student.pt"
    chosen = result.config  # the winning candidate's (its seed is in the lineage)
    meta = ModelMeta(
        arch=chosen.arch,
        num_classes=n_cls,
        class_names=classes,
        frame_size=size,
        width=chosen.width,
        name=p.model_name,
        version=version,
        train_config=chosen.cache_fields(),
    )
    save_checkpoint(ckpt, result.net, meta)
    services.blobs.put(_checkpoint_key(ctx.job_id), ckpt.read_bytes())
    metrics["checkpoint_key"] = _checkpoint_key(ctx.job_id)
    flat = {
        f"{m}_{d}": float(v)
        for m, by_data in evaluation.items()
        for d, v in by_data.items()
        if d in ("holdout", "reference")
    }
    name = serving_info[0] if serving_info is not None else p.model_name
    with services.sessions() as session, session.begin():
        record = registry.register_model(
            session=session,
            blobs=services.blobs,
            key=services.signing_key,
            artifact=int8_path,
            name=name,
            version=version,
            format="int8",
            metrics=flat,
            parent_version=None if serving_info is None else serving_info[1],
            source=f"distill-job:{ctx.job_id}/snapshot:{snapshot_id}",
        )
        registered = f"registered {record.name} {record.version} (parent {record.parent_version})"

        # -- deliver -------------------------------------------------------------
        delivered = "none"
        if p.delivery != "none" and services.announcer is not None and services.topics:
            if p.delivery == "promote":
                registry.promote(
                    session=session,
                    announcer=services.announcer,
                    topics=services.topics,
                    fleet=p.fleet,
                    name=record.name,
                    version=record.version,
                    key=services.signing_key,
                )
                delivered = "promoted"
            else:
                from cloud_service.rollout import create_rollout

                rollout = create_rollout(
                    session=session,
                    announcer=services.announcer,
                    topics=services.topics,
                    fleet=p.fleet,
                    name=record.name,
                    version=record.version,
                    key=services.signing_key,
                    percent=p.canary_percent,
                )
                delivered = f"canary rollout {rollout.id}"
    # Logged after the commit: the log is another transaction (SQLite has one writer).
    ctx.log(registered)
    ctx.log(f"delivery: {delivered}")
    lap("register_deliver")
    metrics.update(
        registered=version,
        delivery=delivered,
        timings=timings,
        wall_s=round(time.perf_counter() - started, 2),
    )
    progress("done", 100)
    return JobOutcome(metrics=metrics, result_version=version, snapshot_id=snapshot_id)


def make_runner(services: PipelineServices) -> Callable[[JobContext], JobOutcome]:
    """The worker's runner: ``DistillWorker(sessions, runner=make_runner(services))``."""

    def runner(ctx: JobContext) -> JobOutcome:
        return run_job(ctx, services)

    return runner
