"""Top-1 accuracy of ONNX or PyTorch models on a frame set, clean or under drift.

``Classifier`` is the one interface evaluation needs: class names, frame size, and
``scores(frames) -> probabilities``. ``OnnxClassifier`` runs a file on ONNX Runtime's
CPU provider in batches; ``TorchClassifier`` runs a network through the same
deployable wrapper the export traces, so both see identical inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from distill.drift import DRIFT_NAMES, Drift, apply_drift, format_drift_spec
from distill.export import INPUT_NAME, OUTPUT_NAME, read_onnx_info
from distill.frames import FrameSet
from distill.models import FramesModel, load_checkpoint
from distill.speed import ort_session
from distill.tasks import CLASSIFICATION_TRAINING, TrainingTask
from shared.errors import DataError, ModelError

__all__ = [
    "DEFAULT_SEVERITIES",
    "Classifier",
    "DriftTable",
    "EvalResult",
    "OnnxClassifier",
    "TorchClassifier",
    "accuracy",
    "align_labels",
    "drift_table",
    "evaluate",
    "load_classifier",
    "predict_scores",
]

DEFAULT_SEVERITIES: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)


class Classifier(Protocol):
    name: str
    class_names: tuple[str, ...]
    frame_size: int

    def scores(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [N, H, W, 3] -> float [N, classes] probabilities."""
        ...


class OnnxClassifier:
    """An EdgeLoop ONNX file on ONNX Runtime (CPU)."""

    def __init__(self, path: Path, *, threads: int = 0, batch_size: int = 256) -> None:
        self.info = read_onnx_info(Path(path))
        self.name = f"{self.info.name} ({self.info.precision})"
        self.class_names = self.info.labels
        self.frame_size = self.info.frame_size
        self.batch_size = batch_size
        try:
            # threads=0 lets ONNX Runtime pick (all cores) for bulk evaluation.
            self.session = ort_session(Path(path), threads)
        except Exception as exc:
            raise ModelError(f"ONNX Runtime cannot load {path}: {exc}") from exc

    def scores(self, frames: np.ndarray) -> np.ndarray:
        out = [
            np.asarray(
                self.session.run([OUTPUT_NAME], {INPUT_NAME: frames[i : i + self.batch_size]})[0]
            )
            for i in range(0, len(frames), self.batch_size)
        ]
        return np.concatenate(out) if out else np.zeros((0, len(self.class_names)), np.float32)


class TorchClassifier:
    """A network (normalised NCHW in, logits out) evaluated as the deployable wrapper."""

    def __init__(
        self,
        net: nn.Module,
        class_names: Sequence[str],
        frame_size: int,
        *,
        name: str = "torch",
        batch_size: int = 256,
    ) -> None:
        self.model = FramesModel(net).eval()
        self.class_names = tuple(class_names)
        self.frame_size = frame_size
        self.name = name
        self.batch_size = batch_size

    @classmethod
    def from_checkpoint(cls, path: Path) -> TorchClassifier:
        loaded = load_checkpoint(path)
        return cls(
            loaded.net,
            loaded.meta.class_names,
            loaded.meta.frame_size,
            name=f"{loaded.meta.name} (torch)",
        )

    def scores(self, frames: np.ndarray) -> np.ndarray:
        out = []
        with torch.inference_mode():
            for i in range(0, len(frames), self.batch_size):
                batch = np.array(frames[i : i + self.batch_size], dtype=np.uint8, copy=True)
                out.append(self.model(torch.from_numpy(batch)).numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.class_names)), np.float32)


def load_classifier(path: Path, *, threads: int = 0) -> Classifier:
    """An ``.onnx`` file or an EdgeLoop ``.pt`` checkpoint as a Classifier."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"no model at {path}")
    if path.suffix == ".onnx":
        return OnnxClassifier(path, threads=threads)
    if path.suffix in (".pt", ".pth"):
        return TorchClassifier.from_checkpoint(path)
    raise ModelError(f"unknown model file type {path.suffix!r}: expected .onnx or .pt")


def predict_scores(clf: Classifier, frames: np.ndarray) -> np.ndarray:
    if len(frames) and frames.shape[1] != clf.frame_size:
        raise DataError(
            f"frames are {frames.shape[1]} px but model {clf.name} takes {clf.frame_size} px;"
            " load the data at the model's frame size"
        )
    return clf.scores(frames)


def align_labels(data: FrameSet, class_names: Sequence[str]) -> np.ndarray:
    """The data's labels as indices into the model's classes (matched by name)."""
    if tuple(data.class_names) == tuple(class_names):
        return np.asarray(data.labels)
    index = {name: i for i, name in enumerate(class_names)}
    present = set(np.unique(data.labels).tolist())
    # Classes the model lacks are an error only if the data actually has frames of them.
    unknown = [c for i, c in enumerate(data.class_names) if c not in index and i in present]
    if unknown:
        raise DataError(
            f"data has classes the model does not know: {', '.join(unknown)}"
            f" (model classes: {', '.join(class_names)})"
        )
    mapping = np.array([index.get(c, -1) for c in data.class_names], dtype=np.int64)
    return mapping[data.labels]


@dataclass(frozen=True)
class EvalResult:
    model: str
    accuracy: float
    frames: int
    correct: int
    drift: str
    per_class: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "accuracy": self.accuracy,
            "frames": self.frames,
            "correct": self.correct,
            "drift": self.drift,
            "per_class": dict(self.per_class),
        }


def evaluate(
    clf: Classifier,
    data: FrameSet,
    *,
    drift: Sequence[Drift] = (),
    seed: int = 0,
    task: TrainingTask = CLASSIFICATION_TRAINING,
) -> EvalResult:
    """The task's gate metric (top-1 accuracy for classification), overall and per class,
    of ``clf`` on ``data``, optionally drifted."""
    if len(data) == 0:
        raise DataError("nothing to evaluate: the data set is empty")
    labels = align_labels(data, clf.class_names)
    frames = apply_drift(data, drift, seed=seed)
    hits = task.hits(predict_scores(clf, frames), labels)
    per_class = {
        clf.class_names[c]: float(hits[labels == c].mean()) for c in np.unique(labels) if c >= 0
    }
    return EvalResult(
        model=clf.name,
        accuracy=float(hits.mean()),
        frames=len(labels),
        correct=int(hits.sum()),
        drift=format_drift_spec(drift),
        per_class=per_class,
    )


def accuracy(
    clf: Classifier, data: FrameSet, *, drift: Sequence[Drift] = (), seed: int = 0
) -> float:
    return evaluate(clf, data, drift=drift, seed=seed).accuracy


@dataclass(frozen=True)
class DriftTable:
    """Accuracy per model, drift and severity; ``clean`` is severity 0."""

    models: tuple[str, ...]
    drifts: tuple[str, ...]
    severities: tuple[float, ...]
    clean: Mapping[str, float]
    cells: Mapping[str, Mapping[str, Mapping[float, float]]]  # model -> drift -> severity -> acc
    frames: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": list(self.models),
            "drifts": list(self.drifts),
            "severities": list(self.severities),
            "frames": self.frames,
            "clean": dict(self.clean),
            "accuracy": {
                m: {d: {f"{s:g}": a for s, a in row.items()} for d, row in by_drift.items()}
                for m, by_drift in self.cells.items()
            },
        }

    def to_markdown(self) -> str:
        """Rows: drift x severity; columns: models; accuracy in percent."""
        head = "| drift | severity | " + " | ".join(self.models) + " |"
        rule = "|---|---:|" + "---:|" * len(self.models)
        lines = [head, rule]
        lines.append(
            "| clean | 0 | " + " | ".join(f"{100 * self.clean[m]:.1f}" for m in self.models) + " |"
        )
        for d in self.drifts:
            for s in self.severities:
                vals = " | ".join(f"{100 * self.cells[m][d][s]:.1f}" for m in self.models)
                lines.append(f"| {d} | {s:g} | {vals} |")
        return "\n".join(lines)


def drift_table(
    classifiers: Mapping[str, Classifier],
    data: FrameSet,
    *,
    drifts: Sequence[str] = DRIFT_NAMES,
    severities: Sequence[float] = DEFAULT_SEVERITIES,
    seed: int = 0,
) -> DriftTable:
    """Every classifier on the same drifted frames for each (drift, severity)."""
    labels = {name: align_labels(data, clf.class_names) for name, clf in classifiers.items()}

    def acc(name: str, frames: np.ndarray) -> float:
        pred = predict_scores(classifiers[name], frames).argmax(axis=1)
        return float((pred == labels[name]).mean())

    clean = {name: acc(name, data.frames) for name in classifiers}
    cells: dict[str, dict[str, dict[float, float]]] = {n: {} for n in classifiers}
    for d in drifts:
        for s in severities:
            frames = apply_drift(data, (Drift(d, s),), seed=seed)
            for name in classifiers:
                cells[name].setdefault(d, {})[float(s)] = acc(name, frames)
    return DriftTable(
        models=tuple(classifiers),
        drifts=tuple(drifts),
        severities=tuple(float(s) for s in severities),
        clean=clean,
        cells=cells,
        frames=len(data),
    )
