"""One round of distillation: verified frames in, a trained student out.

    reference = reference_sets(data_dir, scenario, classes, frame_size)
    data = assemble_dataset(verified, reference, teacher_path, classes, recipe, rng, report)
    start = warm_start(checkpoints, classes, seed)
    result = train_student(data, start, recipe, version, report)
    temperature = calibrate_confidence(result, calibration_set, recipe, report)

Then ``distill.release`` makes the model files and evaluates them, and
``distill.gate.gate`` decides. The cloud's job runner (``cloud_service.jobs``)
supplies the frames and stores what comes out; docs/architecture.md describes the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from distill.datasets import load_data
from distill.evaluate import OnnxClassifier, align_labels
from distill.frames import FrameSet
from distill.models import build_model, load_checkpoint, transfer_weights
from distill.scenario import DIGIT_CLASSES, ScenarioConfig, render_split
from distill.train import (
    TrainConfig,
    TrainResult,
    fit_temperature,
    fold_temperature,
    random_shift,
    train,
    validation_nll,
)
from shared.errors import DataError

__all__ = [
    "Dataset",
    "LabelledFrames",
    "Recipe",
    "ReferenceSets",
    "Report",
    "VerifiedSplit",
    "WarmStart",
    "assemble_dataset",
    "balance",
    "calibrate_confidence",
    "check_per_class",
    "checkpoint_beside",
    "reference_sets",
    "soft_targets",
    "train_student",
    "warm_start",
]


class Report(Protocol):
    """Where a round reports: log lines and progress (progress may raise to stop it)."""

    def log(self, message: str, level: str = "info") -> None: ...

    def progress(self, phase: str, percent: float) -> None: ...


@dataclass(frozen=True)
class Recipe:
    """The knobs of training, calibration and evaluation (a job's parameters carry them)."""

    model_name: str
    epochs: int
    lr: float
    batch_size: int
    temperature: float
    alpha: float
    patience: int | None
    replay_share: float
    threads: int
    seed: int
    calibration_frames: int
    calibrate_confidence: bool
    shift_px: int
    candidates: int
    drift_eval: str
    drift_eval_frames: int


@dataclass(frozen=True)
class LabelledFrames:
    """Frames (uint8 NHWC), the labels trained on, and the teacher's probabilities."""

    frames: np.ndarray
    labels: np.ndarray  # int64 [N]
    soft: np.ndarray  # float32 [N, classes]


@dataclass(frozen=True)
class VerifiedSplit:
    """The fleet's verified frames, split: trained on, watched, and held out for the gate."""

    train: LabelledFrames
    val: LabelledFrames
    holdout: LabelledFrames


def soft_targets(
    labels: Sequence[int],
    teacher_labels: Sequence[int],
    scores: Sequence[Sequence[float]],
    human: Sequence[bool],
    classes: int,
) -> np.ndarray:
    """Teacher probabilities; where a human overrode the teacher, a smoothed one-hot."""
    out = np.zeros((len(labels), classes), dtype=np.float32)
    for i, (label, teacher, row, by_human) in enumerate(
        zip(labels, teacher_labels, scores, human, strict=True)
    ):
        if (by_human and label != teacher) or len(row) != classes:
            out[i] = 0.05 / classes
            out[i, label] += 0.95
        else:
            out[i] = np.asarray(row, dtype=np.float32)
    return out / out.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------
# Reference frames: replayed, watched, and the fixed set the gate holds a student to


@dataclass(frozen=True)
class ReferenceSets:
    """Labelled frames beside the fleet's samples: replayed in training (``replay``),
    watched for early stopping and confidence calibration (``val``), and the fixed set
    the gate holds the new student to (``test``). From the reference scenario's renders
    when the fleet runs it, else from the job's ``data_dir``, else none."""

    kind: str  # "scenario", "folder" or "none"
    source: str
    replay: FrameSet | None = None
    val: FrameSet | None = None
    test: FrameSet | None = None

    def calibration_set(self, job_val: FrameSet) -> FrameSet:
        """The frames confidence is calibrated on: the reference scenario's whole
        validation split; else the job's own validation frames."""
        if self.kind == "scenario" and self.val is not None:
            return self.val
        return job_val

    def training_labels(self) -> np.ndarray:
        """The labels of the replay and validation frames (they count toward each class)."""
        return np.concatenate(
            [s.labels for s in (self.replay, self.val) if s is not None] or [np.empty(0, np.int64)]
        )


_FOLDER_PARTS = ("train", "validation", "test")


def _frameset(
    frames: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], tag: str
) -> FrameSet:
    return FrameSet(
        frames=frames.astype(np.uint8, copy=False),
        labels=labels.astype(np.int64, copy=False),
        class_names=classes,
        identity=tag,
    )


def _runs_reference_scenario(classes: Sequence[str], size: int, scenario: ScenarioConfig) -> bool:
    """The fleet's models carry the reference scenario's class set at its frame size."""
    return tuple(classes) == DIGIT_CLASSES and size == scenario.frame_size


def _folder_split(root: str, split: str, classes: tuple[str, ...], size: int) -> FrameSet | None:
    """One split of a labelled folder, its labels as indices into the fleet's classes;
    None when no file of the folder falls into that split."""
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


def reference_sets(
    data_dir: str, scenario: ScenarioConfig, classes: tuple[str, ...], size: int
) -> ReferenceSets:
    """The ``data_dir`` folder's splits; else the reference scenario's renders when the
    fleet's models carry its classes (the digits); else none."""
    if data_dir:
        parts = {s: _folder_split(data_dir, s, classes, size) for s in _FOLDER_PARTS}
        return ReferenceSets(
            "folder",
            f"data_dir {data_dir}",
            replay=parts["train"],
            val=parts["validation"],
            test=parts["test"],
        )
    if _runs_reference_scenario(classes, size, scenario):
        return ReferenceSets(
            "scenario",
            "the reference scenario",
            replay=render_split("train", scenario),
            val=render_split("validation", scenario),
            test=render_split("test", scenario),
        )
    return ReferenceSets("none", "no reference set (the fleet's own samples only)")


def check_per_class(
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


# ---------------------------------------------------------------------------------
# The training set: verified frames, class-balanced, plus replay scored by the teacher


@dataclass(frozen=True)
class Dataset:
    """What a student trains on, is watched on, and is judged on."""

    train: FrameSet  # balanced verified frames, then replay
    soft: np.ndarray  # the teacher's probabilities for ``train``
    val: FrameSet  # verified validation frames and as many reference ones
    holdout: FrameSet
    recent: np.ndarray  # the verified training frames as they arrived (before balancing)
    recent_val: np.ndarray  # the verified validation frames
    replay: np.ndarray  # the replay frames in ``train``

    @property
    def frame_size(self) -> int:
        return int(self.holdout.frames.shape[1])


def balance(labels: np.ndarray, rng: np.random.Generator, classes: int) -> np.ndarray:
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


def _teacher(
    path: Path | None, classes: tuple[str, ...], threads: int, report: Report
) -> OnnxClassifier | None:
    """The teacher that scores replay frames, when it answers with the fleet's classes."""
    if path is None:
        return None
    teacher = OnnxClassifier(path, threads=threads)
    if tuple(teacher.class_names) == classes:
        return teacher
    report.log(
        f"teacher {path.name} has other classes"
        f" ({', '.join(teacher.class_names)}): replay frames keep their own labels",
        level="warning",
    )
    return None


def _replay(
    pool: FrameSet | None,
    verified: int,
    teacher: OnnxClassifier | None,
    share: float,
    rng: np.random.Generator,
    shape: tuple[int, int],
) -> LabelledFrames:
    """Replay frames making up ``share`` of the training set, scored by the teacher
    (a smoothed one-hot of their own labels without one)."""
    size, n_cls = shape
    n = 0
    if pool is not None and len(pool):
        n = min(round(verified * share / max(1e-6, 1.0 - share)), len(pool))
    if pool is None:
        frames, labels = np.empty((0, size, size, 3), np.uint8), np.empty(0, np.int64)
    else:
        idx = np.sort(rng.choice(len(pool), n, replace=False)) if n else np.empty(0, np.int64)
        frames, labels = pool.frames[idx], pool.labels[idx]
    if teacher is not None and n:
        soft = teacher.scores(frames).astype(np.float32)
    else:
        soft = np.full((n, n_cls), 0.05 / n_cls, dtype=np.float32)
        soft[np.arange(n), labels] += 0.95
    return LabelledFrames(frames, labels, soft)


def _watched(
    val: LabelledFrames, ref_val: FrameSet | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Verified validation frames and as many reference ones (50 at least, when the set
    has them), so early stopping stops neither on drift alone nor on the clean line alone."""
    if ref_val is None or not len(ref_val):
        return val.frames, val.labels
    n = min(len(ref_val), max(len(val.frames), 50))
    idx = np.sort(rng.choice(len(ref_val), n, replace=False))
    return (
        np.concatenate([val.frames, ref_val.frames[idx]]),
        np.concatenate([val.labels, ref_val.labels[idx]]),
    )


def assemble_dataset(
    verified: VerifiedSplit,
    reference: ReferenceSets,
    teacher_path: Path | None,
    classes: tuple[str, ...],
    recipe: Recipe,
    rng: np.random.Generator,
    report: Report,
) -> Dataset:
    """Class-balanced verified frames plus a ``replay_share`` of reference frames."""
    n_cls, size = len(classes), verified.train.frames.shape[1]
    keep = balance(verified.train.labels, rng, n_cls)
    x_ver, y_ver = verified.train.frames[keep], verified.train.labels[keep]
    s_ver = verified.train.soft[keep]
    teacher = _teacher(teacher_path, classes, recipe.threads, report)
    rep = _replay(reference.replay, len(x_ver), teacher, recipe.replay_share, rng, (size, n_cls))
    x_train, y_train = np.concatenate([x_ver, rep.frames]), np.concatenate([y_ver, rep.labels])
    x_val, y_val = _watched(verified.val, reference.val, rng)
    hold = verified.holdout
    data = Dataset(
        train=_frameset(x_train, y_train, classes, "job-train"),
        soft=np.concatenate([s_ver, rep.soft]).astype(np.float32),
        val=_frameset(x_val, y_val, classes, "job-val"),
        holdout=_frameset(hold.frames, hold.labels, classes, "job-holdout"),
        recent=verified.train.frames,
        recent_val=verified.val.frames,
        replay=rep.frames,
    )
    report.log(
        f"dataset: {len(x_ver)} verified (class-balanced) + {len(rep.frames)} replay frames,"
        f" {len(data.val)} validation, {len(data.holdout)} held out"
    )
    return data


# ---------------------------------------------------------------------------------
# Training: warm start, candidates, confidence calibration


def checkpoint_beside(model: Path) -> Path:
    """The checkpoint ``models train`` wrote beside a model: NAME.pt for NAME.onnx, and
    for the NAME.int8.onnx that ``models quantize`` made of it."""
    stem = model.name.removesuffix(".onnx").removesuffix(".int8")
    return model.with_name(f"{stem}.pt")


@dataclass(frozen=True)
class WarmStart:
    """The weights a round starts from, and a line saying where they came from."""

    state: dict[str, Any]
    arch: str
    width: float
    source: str
    note: str


def warm_start(
    candidates: Sequence[tuple[str, Path]],
    classes: tuple[str, ...],
    seed: int,
) -> WarmStart:
    """Weights to start from: the first ``(what, path)`` checkpoint that exists, with a
    fresh head when its class set is not the fleet's; a fresh student when there is none."""
    found = next(((what, c) for what, c in candidates if c.is_file()), None)
    torch.manual_seed(seed)
    if found is None:
        net = build_model("student-cnn", len(classes))
        return WarmStart(
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
        return WarmStart(
            base.net.state_dict(),
            base.meta.arch,
            base.meta.width,
            what,
            f"warm start from {what} ({base.meta.name} {base.meta.version})",
        )
    net = build_model(base.meta.arch, len(classes), base.meta.width)
    fresh = transfer_weights(net, base.net.state_dict())
    return WarmStart(
        net.state_dict(),
        base.meta.arch,
        base.meta.width,
        what,
        f"warm start from {what}: its {base.meta.num_classes} classes"
        f" ({', '.join(base.meta.class_names)}) are not the fleet's {len(classes)}"
        f" ({', '.join(classes)}); kept its features, re-initialised {', '.join(fresh)}",
    )


def _step_reporter(report: Report, offset: float, share: float) -> Callable[[int, int], None]:
    """Training steps as the ``share`` of the job's percent that starts at ``offset``."""

    def on_step(step: int, total: int) -> None:
        report.progress("train", offset + share * step / max(1, total))

    return on_step


def _train_one(
    data: Dataset,
    start: WarmStart,
    recipe: Recipe,
    seed: int,
    version: str,
    on_step: Callable[[int, int], None],
) -> TrainResult:
    cfg = TrainConfig.for_role(
        "student",
        arch=start.arch,
        width=start.width,
        epochs=recipe.epochs,
        lr=recipe.lr,
        batch_size=recipe.batch_size,
        temperature=recipe.temperature,
        alpha=recipe.alpha,
        threads=recipe.threads,
        seed=seed,
        frame_size=data.frame_size,
    )
    shift = recipe.shift_px
    return train(
        cfg,
        data.train,
        data.val if len(data.val) else None,
        soft_targets=data.soft,
        name=recipe.model_name,
        version=version,
        progress=False,
        init_state=start.state,
        on_step=on_step,
        patience=recipe.patience,
        keep_last=recipe.patience is None,
        augment=None if shift <= 0 else lambda frames, g: random_shift(frames, g, max_px=shift),
    )


def train_student(
    data: Dataset, start: WarmStart, recipe: Recipe, version: str, report: Report
) -> TrainResult:
    """Train ``candidates`` students (seeds seed, seed+1, ...) with the Hinton loss; the one
    with the lowest validation NLL is kept (the train phase runs from 5 to 65 percent)."""
    candidates: list[tuple[float, TrainResult]] = []
    n = recipe.candidates
    for c in range(n):
        on_step = _step_reporter(report, 5 + 60 * c / n, 60 / n)
        trained = _train_one(data, start, recipe, recipe.seed + c, version, on_step)
        val_nll = validation_nll(trained.net, data.val.frames, data.val.labels)
        candidates.append((val_nll, trained))
        if n > 1:
            report.log(f"candidate {c + 1}/{n} (seed {recipe.seed + c}): val NLL {val_nll:.4f}")
    # Several seeds, the lowest validation NLL wins: one run's luck moves a few hundred
    # frames' student by a point; the gate still judges the winner on the holdout.
    val_nll, result = min(candidates, key=lambda pair: pair[0])
    result.metrics["val_nll"] = round(val_nll, 5)
    result.metrics["candidates_val_nll"] = [round(v, 5) for v, _ in candidates]
    result.metrics["seed"] = result.config.seed
    report.log(
        f"trained from {start.source}: best epoch"
        f" {result.metrics['best_epoch']} of {len(result.history)},"
        f" val {result.metrics.get('val_acc', float('nan')):.3f}"
    )
    return result


def calibrate_confidence(
    result: TrainResult, frames: FrameSet, recipe: Recipe, report: Report
) -> float:
    """Fold into the student the softmax temperature at which its mean confidence on
    ``frames`` equals its accuracy; the temperature (1.0 when off or without frames).

    The edge forwards a frame when its confidence is below a threshold; this makes that
    threshold mean the same for every student."""
    if not recipe.calibrate_confidence or not len(frames):
        return 1.0
    temperature = fit_temperature(result.net, frames.frames, frames.labels)
    fold_temperature(result.net, temperature)
    report.log(f"confidence calibrated on {len(frames)} validation frames: T = {temperature:.3f}")
    return temperature
