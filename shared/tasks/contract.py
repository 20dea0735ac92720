"""The task contract: what every task implements, and the answers it deals in.

``docs/architecture.md``, "The task contract", has the table of what a task decides;
``shared.tasks`` holds the implementations and the registry. Contracts layer: numpy
only, no runtime imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

__all__ = ["Answer", "Box", "Comparison", "Signals", "Task", "unit"]

# A detected object: x1, y1, x2, y2 (fractions of the frame), score, class index.
Box = tuple[float, float, float, float, float, int]


@dataclass(frozen=True)
class Answer:
    """One model's answer for one frame: a label index and confidence that summarise it,
    its scores, and (for detection) its boxes, each ``x1, y1, x2, y2, score, class`` with
    the corners as fractions of the frame."""

    label: int
    confidence: float
    scores: tuple[float, ...]
    boxes: tuple[Box, ...] = ()


@dataclass(frozen=True)
class Signals:
    """What routing rules read, one entry per frame of a batch."""

    predicted: list[int]
    confidence: list[float]
    margin: list[float]
    entropy: list[float]  # nats

    def __len__(self) -> int:
        return len(self.predicted)


@dataclass(frozen=True)
class Comparison:
    """Student against teacher for one frame."""

    agrees: bool
    differences: tuple[str, ...] = field(default_factory=tuple)  # e.g. ("wrong_class",)


@runtime_checkable
class Task(Protocol):
    """The contract every task implements (see the module docstring's table)."""

    name: ClassVar[str]
    output_name: ClassVar[str]  # the ONNX model's output tensor
    gate_metric: ClassVar[str]
    review_label: ClassVar[str]
    routing_rules: ClassVar[tuple[str, ...]]
    export_formats: ClassVar[tuple[str, ...]]

    def answers(self, outputs: np.ndarray) -> list[Answer]: ...

    def signals(self, outputs: np.ndarray) -> Signals: ...

    def sample_fields(self, output: np.ndarray) -> dict[str, Any]: ...

    def sample_answer(self, header: Any) -> Answer: ...

    def verdict_fields(self, answer: Answer) -> dict[str, Any]: ...

    def verdict_answer(self, verdict: Any) -> Answer: ...

    def compare(self, student: Answer, teacher: Answer) -> Comparison: ...

    def score(self, predicted: Sequence[Answer], truth: Sequence[Any]) -> float: ...

    def golden_rows(self, outputs: np.ndarray) -> list[list[float]]: ...

    def check_golden_width(self, width: int, labels: int) -> None: ...

    def golden_difference(
        self, expected: Sequence[Sequence[float]], outputs: np.ndarray, atol: float
    ) -> float: ...


def unit(value: float) -> float:
    """A score or confidence as the messages carry it: within [0, 1] (float rounding
    can overshoot)."""
    v = float(value)
    return 1.0 if v > 1.0 else v if v > 0.0 else 0.0  # NaN: 0.0, as min/max would give
