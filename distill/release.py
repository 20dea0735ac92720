"""The new student as files and figures: ONNX FP32 and INT8, a checkpoint for the next
round's warm start, and its accuracy beside the serving student's (what ``distill.gate``
judges). The training itself is ``distill.distillation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distill.distillation import Dataset, Recipe, ReferenceSets, Report
from distill.drift import parse_drift_spec
from distill.evaluate import OnnxClassifier, evaluate
from distill.export import export_onnx
from distill.frames import FrameSet
from distill.models import ModelMeta, save_checkpoint
from distill.quantize import quantize_onnx
from distill.train import TrainResult
from shared.tasks import CLASSIFICATION

__all__ = [
    "Evaluation",
    "StudentFiles",
    "calibration_frames",
    "evaluate_student",
    "export_student",
    "write_checkpoint",
]


def calibration_frames(
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


@dataclass(frozen=True)
class StudentFiles:
    """The new student as ONNX FP32 and INT8, and how many frames calibrated the INT8."""

    fp32: Path
    int8: Path
    int8_frames: int


def export_student(
    result: TrainResult,
    work_dir: Path,
    data: Dataset,
    classes: tuple[str, ...],
    recipe: Recipe,
    version: str,
    rng: np.random.Generator,
    report: Report,
) -> StudentFiles:
    """Export to ONNX (optimised, checked on the holdout), then INT8 static QDQ calibrated
    on recent verified and replay frames (never the holdout the gate judges on)."""
    fp32_path, int8_path = work_dir / "student.onnx", work_dir / "student.int8.onnx"
    export = export_onnx(
        result.net,
        fp32_path,
        class_names=classes,
        frame_size=data.frame_size,
        name=recipe.model_name,
        version=version,
        check_frames=data.holdout.frames,
    )
    report.log(
        f"exported: {export.nodes_unoptimized} -> {export.nodes_final} nodes after optimisation"
    )
    report.progress("quantize", 72)
    calib = calibration_frames(
        data.recent, data.recent_val, data.replay, recipe.calibration_frames, rng
    )
    quant = quantize_onnx(fp32_path, int8_path, calib)
    report.log(
        f"INT8: {quant.size_bytes} bytes, calibrated on {len(calib)} frames"
        " (recent verified and replay; the holdout is kept out)"
    )
    return StudentFiles(fp32_path, int8_path, len(calib))


def write_checkpoint(
    result: TrainResult, path: Path, classes: tuple[str, ...], size: int, name: str, version: str
) -> Path:
    """The winning student's weights and metadata, for the next round's warm start."""
    chosen = result.config  # the winning candidate's (its seed is in the lineage)
    meta = ModelMeta(
        arch=chosen.arch,
        num_classes=len(classes),
        class_names=classes,
        frame_size=size,
        width=chosen.width,
        name=name,
        version=version,
        train_config=chosen.cache_fields(),
    )
    save_checkpoint(path, result.net, meta)
    return path


# ---------------------------------------------------------------------------------
# Evaluation


@dataclass(frozen=True)
class Evaluation:
    """``accuracy[model][dataset]`` (models new_fp32, new_int8, serving) and frames per set.

    ``metric`` names the figure: the task's gate metric (``shared.tasks``).
    """

    accuracy: dict[str, dict[str, float]]
    sizes: dict[str, int]
    metric: str = CLASSIFICATION.gate_metric


def evaluate_student(
    files: StudentFiles,
    serving: Path,
    holdout: FrameSet,
    reference: ReferenceSets,
    recipe: Recipe,
    rng: np.random.Generator,
    report: Report,
) -> Evaluation:
    """New FP32, new INT8 and the serving student on the holdout, the reference test set
    (when there is one), and the reference set (else the holdout) under each drift."""
    models = {
        "new_fp32": OnnxClassifier(files.fp32, threads=recipe.threads),
        "new_int8": OnnxClassifier(files.int8, threads=recipe.threads),
        "serving": OnnxClassifier(serving, threads=recipe.threads),
    }
    eval_sets: dict[str, tuple[FrameSet, tuple[Any, ...]]] = {"holdout": (holdout, ())}
    sizes = {"holdout": len(holdout)}
    ref_test = reference.test
    if ref_test is not None and len(ref_test):
        eval_sets["reference"] = (ref_test, ())
        sizes["reference"] = len(ref_test)
    drift_base = ref_test if ref_test is not None and len(ref_test) else holdout
    n_eval = min(len(drift_base), recipe.drift_eval_frames)
    drift_small = drift_base.subset(np.sort(rng.choice(len(drift_base), n_eval, replace=False)))
    for drift in parse_drift_spec(recipe.drift_eval):
        eval_sets[f"drift:{drift}"] = (drift_small, (drift,))
    accuracy: dict[str, dict[str, float]] = {m: {} for m in models}
    for i, (dname, (data, spec)) in enumerate(eval_sets.items()):
        for mname, clf in models.items():
            accuracy[mname][dname] = round(evaluate(clf, data, drift=spec, seed=1).accuracy, 4)
        report.progress("evaluate", 78 + 14 * (i + 1) / len(eval_sets))
    report.log(
        f"evaluated on {len(holdout)} held-out samples"
        + (
            f" and {sizes['reference']} reference frames ({reference.source})"
            if "reference" in sizes
            else ""
        )
    )
    return Evaluation(accuracy, sizes)
