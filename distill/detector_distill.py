"""One distillation round for a detector: the refreshed student from teacher boxes and
human corrections, with replay, INT8, and the release gate on mAP.

    frames + teacher boxes (+ reviewers' boxes) -> split train / holdout
        -> train (warm start from the serving student; replay of labelled frames)
        -> export FP32 -> INT8 (calibrated on the round's and the replay's frames)
        -> evaluate new FP32, new INT8 and serving: holdout, reference, each drift
        -> gate (``distill.gate`` with the detection task's metric, mAP@0.5)

Pure ML, like the rest of ``distill``: arrays and files in, model files and figures
out; who delivers the model is the caller's business. A reviewer's boxes replace the
teacher's for their frame (``merge_labels``). The holdout is judged against the same
merged labels (the teacher's boxes where no human looked), which is what the cloud
knows about recent frames; the reference set is ground truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distill.detector_eval import OnnxDetector, coco_metrics
from distill.detector_export import export_detector, quantize_detector
from distill.detector_train import (
    DetTrainConfig,
    FrameBoxes,
    labels_from_set,
    merge_labels,
    train_detector,
)
from distill.detectors import DetectorMeta, load_detector, save_detector
from distill.gate import GateDecision, gate
from distill.scene_drift import apply_scene_drift
from distill.scenes import DetectionSet
from shared.errors import DataError
from shared.tasks import DETECTION

__all__ = ["DetectorGate", "DetectorRound", "distil_detector", "labelled_set"]


@dataclass(frozen=True)
class DetectorGate:
    """The release rule's thresholds, in mAP@0.5 (fractions, not points)."""

    min_gain: float = 0.0
    max_reference_drop: float = 0.02
    int8_tolerance: float = 0.015
    max_drift_drop: float | None = 0.05


@dataclass
class DetectorRound:
    """What a round made and how it was judged."""

    fp32: Path
    int8: Path
    checkpoint: Path
    evaluation: dict[str, dict[str, float]]  # model -> data set -> mAP@0.5
    evaluation_50_95: dict[str, dict[str, float]]
    sizes: dict[str, int]
    decision: GateDecision
    metrics: dict[str, Any] = field(default_factory=dict)


def labelled_set(
    frames: np.ndarray, labels: Sequence[FrameBoxes], class_names: Sequence[str]
) -> DetectionSet:
    """Frames and their labels (at or above any score) as a set to score models on."""
    return DetectionSet(
        frames=frames,
        boxes=[lab.boxes for lab in labels],
        classes=[lab.classes for lab in labels],
        class_names=tuple(class_names),
    )


def _split(n: int, holdout_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    held = max(1, round(n * holdout_share))
    if n - held < 1:
        raise DataError(f"{n} frames are too few to train on and hold out")
    return np.sort(order[held:]), np.sort(order[:held])


def distil_detector(
    *,
    frames: np.ndarray,
    teacher: Sequence[FrameBoxes],
    human: Sequence[FrameBoxes | None],
    serving_checkpoint: Path,
    serving_onnx: Path,
    reference: DetectionSet | None,
    replay: DetectionSet | None,
    drifts: Sequence[str],
    out_dir: Path,
    config: DetTrainConfig,
    version: str,
    name: str = "student-det",
    holdout_share: float = 0.2,
    thresholds: DetectorGate = DetectorGate(),
    seed: int = 0,
    holdout: Sequence[int] | None = None,
) -> DetectorRound:
    """Train, export, quantize, evaluate and gate one refreshed student (see the module).

    ``holdout`` names the frames the gate judges on (the rest train); without it a
    seeded ``holdout_share`` of them. Without a ``reference`` set the gate holds the new
    student to the holdout alone, and no drift is evaluated.
    """
    if not len(frames) == len(teacher) == len(human):
        raise DataError(f"{len(frames)} frames, {len(teacher)} teacher and {len(human)} labels")
    out_dir.mkdir(parents=True, exist_ok=True)
    serving = load_detector(serving_checkpoint)
    class_names = serving.meta.class_names
    labels = merge_labels(human, teacher)
    if holdout is None:
        train_idx, hold_idx = _split(len(frames), holdout_share, seed)
    else:
        hold_idx = np.unique(np.asarray(holdout, dtype=np.int64))
        train_idx = np.setdiff1d(np.arange(len(frames)), hold_idx)
        if not len(hold_idx) or not len(train_idx) or hold_idx.max() >= len(frames):
            raise DataError(f"holdout {len(hold_idx)} of {len(frames)} frames leaves none to train")
    replay_data = (replay.frames, labels_from_set(replay)) if replay is not None else None
    result = train_detector(
        config,
        frames[train_idx],
        [labels[i] for i in train_idx],
        class_names=class_names,
        replay=replay_data,
        init=serving.net,
    )
    fp32, int8, checkpoint = (
        out_dir / "student.onnx",
        out_dir / "student.int8.onnx",
        out_dir / "student.pt",
    )
    export = export_detector(
        result.net,
        fp32,
        class_names=class_names,
        frame_size=config.frame_size,
        name=name,
        version=version,
        check_frames=frames[hold_idx][:16],
    )
    calibration = frames[train_idx]
    if replay is not None:
        calibration = np.concatenate([calibration, replay.frames[: len(train_idx)]])
    quant = quantize_detector(fp32, int8, calibration)
    save_detector(
        checkpoint,
        result.net,
        DetectorMeta(
            arch=config.arch,
            class_names=class_names,
            frame_size=config.frame_size,
            width=config.width,
            name=name,
            version=version,
            train_config=config.cache_fields(),
        ),
    )

    sets = {"holdout": labelled_set(frames[hold_idx], [labels[i] for i in hold_idx], class_names)}
    if reference is not None:
        sets["reference"] = reference
        for spec in drifts:
            sets[f"drift:{spec}"] = apply_scene_drift(reference, spec, seed=seed + 1)
    models = {"new_fp32": fp32, "new_int8": int8, "serving": serving_onnx}
    map50: dict[str, dict[str, float]] = {m: {} for m in models}
    map50_95: dict[str, dict[str, float]] = {m: {} for m in models}
    for model, path in models.items():
        detector = OnnxDetector(path, threads=config.threads)
        for data_name, data in sets.items():
            scored = coco_metrics(detector.detections(data.frames), data)
            map50[model][data_name] = round(scored.map50, 4)
            map50_95[model][data_name] = round(scored.map50_95, 4)
    decision = gate(
        map50,
        min_gain=thresholds.min_gain,
        max_reference_drop=thresholds.max_reference_drop,
        int8_tolerance=thresholds.int8_tolerance,
        max_drift_drop=thresholds.max_drift_drop,
        metric=DETECTION.gate_metric,
    )
    return DetectorRound(
        fp32=fp32,
        int8=int8,
        checkpoint=checkpoint,
        evaluation=map50,
        evaluation_50_95=map50_95,
        sizes={k: len(v) for k, v in sets.items()},
        decision=decision,
        metrics={
            "train": result.metrics,
            "export": export.to_dict(),
            "quantization": quant.to_dict(),
            "frames": {"train": len(train_idx), "holdout": len(hold_idx)},
            "human_labels": sum(h is not None for h in human),
            "replay_frames": 0 if replay is None else len(replay),
        },
    )
