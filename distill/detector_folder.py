"""A detector trained on a user's labelled folder (COCO JSON or YOLO txt).

    folder -> frames at the model's size, boxes -> split train / validation / test
           -> train (the role's recipe) -> checkpoint (.pt) -> ONNX (FP32)
           -> INT8 (students; calibrated on training frames) -> COCO mAP on the test split

What ``edgeloop models train --task detection`` runs. The split is a seeded
permutation of the folder's frames (``validation_share`` and ``test_share`` of them,
at least one frame each when the folder has three or more). The files written are
the ones a fleet serves and a distillation job warm-starts from: ``NAME.pt``,
``NAME.onnx`` and, for a student, ``NAME.int8.onnx`` beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console

from distill.detector_eval import evaluate_detector
from distill.detector_export import export_detector, quantize_detector
from distill.detector_train import DetTrainConfig, labels_from_set, train_detector
from distill.detectors import DetectorMeta, detector_profile, save_detector
from distill.scenes import DetectionSet
from shared.errors import DataError

__all__ = ["FolderSplit", "split_folder", "train_folder_detector"]


@dataclass(frozen=True)
class FolderSplit:
    train: DetectionSet
    validation: DetectionSet | None
    test: DetectionSet | None


def split_folder(
    data: DetectionSet, *, validation_share: float = 0.1, test_share: float = 0.1, seed: int = 0
) -> FolderSplit:
    """A seeded split of a labelled folder's frames (see the module docstring)."""
    n = len(data)
    if n < 1:
        raise DataError("the folder holds no labelled frames")
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, round(n * validation_share)) if n >= 3 and validation_share > 0 else 0
    n_test = max(1, round(n * test_share)) if n >= 3 and test_share > 0 else 0
    val, test, train = (
        order[:n_val],
        order[n_val : n_val + n_test],
        order[n_val + n_test :],
    )
    return FolderSplit(
        train=data.subset(np.sort(train)),
        validation=data.subset(np.sort(val)) if len(val) else None,
        test=data.subset(np.sort(test)) if len(test) else None,
    )


def train_folder_detector(
    data: DetectionSet,
    out: Path,
    *,
    role: Literal["teacher", "student"],
    name: str,
    overrides: dict[str, Any] | None = None,
    validation_share: float = 0.1,
    test_share: float = 0.1,
    progress: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Train, save, export (and for a student quantize) a detector; its report."""
    started = time.perf_counter()
    size = int(data.frames.shape[1])
    cfg = DetTrainConfig(role=role, frame_size=size, crop=0 if size <= 192 else 160)
    cfg = cfg.with_(**(overrides or {}))
    parts = split_folder(
        data, validation_share=validation_share, test_share=test_share, seed=cfg.seed
    )
    result = train_detector(
        cfg,
        parts.train.frames,
        labels_from_set(parts.train),
        class_names=data.class_names,
        val_set=parts.validation,
        progress=progress,
        console=console,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx_path = out.with_suffix(".onnx")
    checks = parts.test.frames if parts.test is not None else parts.train.frames[:16]
    export = export_detector(
        result.net,
        onnx_path,
        class_names=data.class_names,
        frame_size=size,
        name=name,
        version="0",
        check_frames=checks,
    )
    save_detector(
        out,
        result.net,
        DetectorMeta(
            arch=cfg.arch,
            class_names=tuple(data.class_names),
            frame_size=size,
            width=cfg.width,
            name=name,
            version="0",
            train_config=cfg.cache_fields(),
        ),
    )
    profile = detector_profile(result.net, size)
    report: dict[str, Any] = {
        "task": "detection",
        "checkpoint": str(out),
        "onnx": str(onnx_path),
        "classes": list(data.class_names),
        "train_frames": len(parts.train),
        "validation_frames": 0 if parts.validation is None else len(parts.validation),
        "test_frames": 0 if parts.test is None else len(parts.test),
        "params": profile["params"],
        "macs_per_frame": profile["macs"],
        "export_max_diff_vs_torch": export.max_diff_vs_torch,
    }
    if parts.test is not None:
        fp32 = evaluate_detector(onnx_path, parts.test)
        report.update(test_map50=round(fp32.map50, 4), test_map50_95=round(fp32.map50_95, 4))
    if role == "student":
        int8_path = out.with_name(f"{out.stem}.int8.onnx")
        calibration = parts.train.frames[: min(256, len(parts.train))]
        quant = quantize_detector(onnx_path, int8_path, calibration)
        report["int8_onnx"] = str(int8_path)
        report["quantization"] = quant.to_dict()
        if parts.test is not None:
            int8 = evaluate_detector(int8_path, parts.test)
            report.update(
                int8_test_map50=round(int8.map50, 4), int8_test_map50_95=round(int8.map50_95, 4)
            )
    report["train_wall_s"] = round(time.perf_counter() - started, 2)
    return report
