"""Classification, the first task: one label per frame from a row of class probabilities.

An answer is a probability row, its label the arg-max; student and teacher agree when
their labels are equal; the gate judges top-1 accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from shared.tasks.contract import Answer, Comparison, Signals, unit

__all__ = ["CLASSIFICATION", "ClassificationTask"]


class ClassificationTask:
    """One label per frame from a row of class probabilities."""

    name: ClassVar[str] = "classification"
    output_name: ClassVar[str] = "scores"
    gate_metric: ClassVar[str] = "top1_accuracy"
    review_label: ClassVar[str] = "class"
    routing_rules: ClassVar[tuple[str, ...]] = (
        "low_confidence",
        "margin",
        "entropy",
        "class_threshold",
    )
    export_formats: ClassVar[tuple[str, ...]] = (
        "csv",
        "json",
        "imagefolder",
        "zip",
        "coco",
        "yolo",
        "labelstudio",
    )

    @staticmethod
    def _rows(outputs: np.ndarray) -> np.ndarray:
        p = np.asarray(outputs, dtype=np.float64)
        if p.ndim != 2 or p.shape[1] < 1:
            raise ValueError(f"expected a [N, classes] batch of scores, got shape {p.shape}")
        return p

    def answers(self, outputs: np.ndarray) -> list[Answer]:
        """The arg-max label and its probability for each row."""
        p = self._rows(outputs)
        labels = p.argmax(axis=1)
        return [
            Answer(int(label), float(row[label]), tuple(float(x) for x in row))
            for label, row in zip(labels, p, strict=True)
        ]

    def signals(self, outputs: np.ndarray) -> Signals:
        """Arg-max, its probability, the top-2 margin and the entropy of each row, at once."""
        p = self._rows(outputs)
        predicted = p.argmax(axis=1)
        ordered = np.sort(p, axis=1)  # a few classes: cheaper than partition, same values
        top = ordered[:, -1]
        second = ordered[:, -2] if p.shape[1] > 1 else np.zeros(len(p))
        entropy = -(p * np.log(np.minimum(np.maximum(p, 1e-12), 1.0))).sum(axis=1)
        return Signals(predicted.tolist(), top.tolist(), (top - second).tolist(), entropy.tolist())

    def sample_fields(self, output: np.ndarray) -> dict[str, Any]:
        """The edge's answer for one frame (its model's output row) as sample-header fields."""
        row = np.asarray(output, dtype=np.float64).reshape(-1)
        if row.size < 1:
            raise ValueError("expected a row of class scores, got none")
        label = int(row.argmax())
        scores = row.tolist()
        return {"scores": scores, "predicted": label, "confidence": unit(scores[label])}

    def sample_answer(self, header: Any) -> Answer:
        """The edge's answer from a sample header (which the message schema has checked)."""
        return self._answer(header.predicted, header.confidence, header.scores)

    def verdict_fields(self, answer: Answer) -> dict[str, Any]:
        """The teacher's answer as verdict fields."""
        return {
            "scores": list(answer.scores),
            "label": answer.label,
            "confidence": unit(answer.confidence),
        }

    def verdict_answer(self, verdict: Any) -> Answer:
        """The teacher's answer from a verdict (which the message schema has checked)."""
        return self._answer(verdict.label, verdict.confidence, verdict.scores)

    @staticmethod
    def _answer(label: int, confidence: float | None, scores: Sequence[float]) -> Answer:
        row = tuple(float(x) for x in scores)
        if not 0 <= label < len(row):
            raise ValueError(f"label {label} is not an index into {len(row)} scores")
        return Answer(int(label), float(row[label] if confidence is None else confidence), row)

    def compare(self, student: Answer, teacher: Answer) -> Comparison:
        """They agree when their labels are equal."""
        if student.label == teacher.label:
            return Comparison(True)
        return Comparison(False, ("wrong_class",))

    def score(self, predicted: Sequence[Answer], truth: Sequence[int]) -> float:
        """Top-1 accuracy (0.0 on no frames)."""
        if len(predicted) != len(truth):
            raise ValueError(f"{len(predicted)} answers for {len(truth)} labels")
        if not truth:
            return 0.0
        return sum(a.label == int(t) for a, t in zip(predicted, truth, strict=True)) / len(truth)

    # --- golden cases (a manifest's check that an agent's runtime computes the same) ----

    def golden_rows(self, outputs: np.ndarray) -> list[list[float]]:
        """One row of class scores per golden frame."""
        return [[float(x) for x in row] for row in self._rows(outputs)]

    def check_golden_width(self, width: int, labels: int) -> None:
        """ValueError unless a golden row holds one score per label."""
        if width != labels:
            raise ValueError(f"{width} scores per input for {labels} labels")

    def golden_difference(
        self, expected: Sequence[Sequence[float]], outputs: np.ndarray, atol: float
    ) -> float:
        """The largest absolute difference between the expected and the given scores."""
        want = np.asarray(expected, dtype=np.float64)
        got = np.asarray(outputs, dtype=np.float64)
        if got.shape != want.shape:
            raise ValueError(f"gave shape {list(got.shape)}, expected {list(want.shape)}")
        return float(np.max(np.abs(got - want))) if got.size else 0.0


CLASSIFICATION = ClassificationTask()
