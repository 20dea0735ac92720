"""Scoring an ONNX detector on a ``DetectionSet`` with pycocotools: mAP@0.5 and mAP@0.5:0.95.

``OnnxDetector`` runs an exported detector (FP32 or INT8) in batches with ONNX
Runtime and returns its raw ``detections`` rows. ``coco_metrics`` scores rows
against a set's ground truth with ``COCOeval`` (bbox, 101-point interpolation,
averaged over the classes that have ground truth), the same computation the gate
uses; ``shared.tasks.detection.average_precision`` is its numpy twin on the edge.
Every row with a score above zero counts (COCO keeps the 100 best per frame; a frame
has at most ``K`` rows). ``evaluate_under_drift`` scores the same model on the set
under each named drift (``distill.scene_drift``), boxes moved with the objects.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from distill.detector_export import DETECTIONS_NAME
from distill.export import INPUT_NAME, read_onnx_info
from distill.scene_drift import apply_scene_drift
from distill.scenes import DetectionSet
from shared.errors import DataError, ModelError

__all__ = [
    "DetMetrics",
    "OnnxDetector",
    "coco_metrics",
    "evaluate_detector",
    "evaluate_under_drift",
]


class OnnxDetector:
    """An exported detector in an ONNX Runtime CPU session."""

    def __init__(self, path: Path, *, threads: int = 0) -> None:
        self.path = Path(path)
        self.info = read_onnx_info(self.path)
        if self.info.metadata.get("task") != "detection":
            raise ModelError(
                f"{self.path} is not a detector (task {self.info.metadata.get('task')})"
            )
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(
                str(self.path), so, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise ModelError(f"cannot load {self.path}: {exc}") from exc

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.info.labels

    def detections(self, frames: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """float32 [N, K, 6] rows for uint8 [N, H, W, 3] frames."""
        size = self.info.frame_size
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (size, size, 3):
            raise DataError(
                f"{self.path.name} takes uint8 [N, {size}, {size}, 3], got"
                f" {frames.dtype} {frames.shape}"
            )
        out = [
            np.asarray(
                self.session.run(
                    [DETECTIONS_NAME],
                    {INPUT_NAME: np.ascontiguousarray(frames[i : i + batch_size])},
                )[0]
            )
            for i in range(0, len(frames), batch_size)
        ]
        if not out:
            return np.zeros((0, int(self.info.metadata.get("max_detections", 0)), 6), np.float32)
        return np.concatenate(out).astype(np.float32)


@dataclass(frozen=True)
class DetMetrics:
    """COCO box metrics of one model on one set."""

    map50: float
    map50_95: float
    frames: int
    objects: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "map50": round(self.map50, 5),
            "map50_95": round(self.map50_95, 5),
            "frames": self.frames,
            "objects": self.objects,
        }


def _coco_ground_truth(ds: DetectionSet) -> dict[str, Any]:
    images = [
        {"id": i + 1, "width": ds.frame_size, "height": ds.frame_size} for i in range(len(ds))
    ]
    annotations: list[dict[str, Any]] = []
    for i, (boxes, classes) in enumerate(zip(ds.boxes, ds.classes, strict=True)):
        for (x1, y1, x2, y2), c in zip(boxes.tolist(), classes.tolist(), strict=True):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i + 1,
                    "category_id": int(c) + 1,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": c + 1, "name": name} for c, name in enumerate(ds.class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def coco_metrics(detections: np.ndarray, ds: DetectionSet) -> DetMetrics:
    """mAP@0.5 and mAP@0.5:0.95 (pycocotools, bbox) of ``[N, K, 6]`` rows on ``ds``."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    d = np.asarray(detections, dtype=np.float64)
    if d.ndim != 3 or d.shape[0] != len(ds) or d.shape[2] != 6:
        raise DataError(f"expected [{len(ds)}, K, 6] detections, got {d.shape}")
    objects = int(ds.object_counts().sum())
    w = h = float(ds.frame_size)
    results = [
        {
            "image_id": i + 1,
            "category_id": int(r[5]) + 1,
            "bbox": [r[0] * w, r[1] * h, (r[2] - r[0]) * w, (r[3] - r[1]) * h],
            "score": float(r[4]),
        }
        for i, frame in enumerate(d)
        for r in frame
        if r[4] > 0
    ]
    if not objects or not results:
        return DetMetrics(0.0, 0.0, len(ds), objects)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints as it goes
        gt = COCO()
        gt.dataset = _coco_ground_truth(ds)
        gt.createIndex()
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, iouType="bbox")
        ev.params.maxDets = [1, 10, 100]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return DetMetrics(
        map50=max(0.0, float(ev.stats[1])),
        map50_95=max(0.0, float(ev.stats[0])),
        frames=len(ds),
        objects=objects,
    )


def evaluate_detector(
    model: OnnxDetector | Path, ds: DetectionSet, *, batch_size: int = 32
) -> DetMetrics:
    """COCO metrics of an ONNX detector (or the path to one) on a set."""
    detector = model if isinstance(model, OnnxDetector) else OnnxDetector(Path(model))
    if detector.class_names != ds.class_names:
        raise DataError(
            f"{detector.path.name} names classes {list(detector.class_names)},"
            f" the set {list(ds.class_names)}"
        )
    return coco_metrics(detector.detections(ds.frames, batch_size), ds)


def evaluate_under_drift(
    model: OnnxDetector | Path,
    ds: DetectionSet,
    specs: Sequence[str],
    *,
    seed: int = 0,
    batch_size: int = 32,
) -> dict[str, DetMetrics]:
    """COCO metrics per drift spec (``""`` is the clean set), in the order given."""
    detector = model if isinstance(model, OnnxDetector) else OnnxDetector(Path(model))
    return {
        spec: evaluate_detector(detector, apply_scene_drift(ds, spec, seed), batch_size=batch_size)
        for spec in specs
    }
