"""The training side of the task contract (``shared/tasks/``; ``docs/architecture.md``,
"The task contract"): the loss a student learns from teacher and labels by, and how
the gate's metric is counted on a model's raw outputs.

Kept here rather than in ``shared/`` because it needs torch, which neither the
contracts nor the edge agent import.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from shared.tasks import CLASSIFICATION, task_for

__all__ = [
    "CLASSIFICATION_TRAINING",
    "ClassificationTraining",
    "TrainingTask",
    "soften",
    "training_for",
]


def soften(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Teacher probabilities -> the teacher's distribution at temperature T."""
    logp = torch.log(probs.clamp_min(1e-8)) / temperature
    return torch.softmax(logp, dim=1)


@runtime_checkable
class TrainingTask(Protocol):
    """How a task's student is trained and judged."""

    name: ClassVar[str]
    gate_metric: ClassVar[str]

    def loss(
        self,
        outputs: torch.Tensor,
        labels: torch.Tensor,
        teacher: torch.Tensor | None,
        *,
        temperature: float,
        alpha: float,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor: ...

    def hits(self, outputs: np.ndarray, labels: np.ndarray) -> np.ndarray: ...


class ClassificationTraining:
    """Hinton distillation: ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE``."""

    name: ClassVar[str] = CLASSIFICATION.name
    gate_metric: ClassVar[str] = CLASSIFICATION.gate_metric

    def loss(
        self,
        outputs: torch.Tensor,
        labels: torch.Tensor,
        teacher: torch.Tensor | None,
        *,
        temperature: float,
        alpha: float,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """CE on hard labels; plus the T^2-scaled KL to the teacher when its scores are given."""
        ce = F.cross_entropy(outputs, labels, label_smoothing=label_smoothing)
        if teacher is None:
            return ce
        t = temperature
        kl = F.kl_div(F.log_softmax(outputs / t, dim=1), soften(teacher, t), reduction="batchmean")
        return alpha * t * t * kl + (1.0 - alpha) * ce

    def hits(self, outputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Per frame, whether the top-1 class is the label (the mean is top-1 accuracy)."""
        return np.asarray(outputs).argmax(axis=1) == np.asarray(labels)


CLASSIFICATION_TRAINING = ClassificationTraining()

_TRAINING: Mapping[str, TrainingTask] = MappingProxyType(
    {CLASSIFICATION_TRAINING.name: CLASSIFICATION_TRAINING}
)


def training_for(name: str | None) -> TrainingTask:
    """The training side of a task (``None``: classification)."""
    task = task_for(name)  # an unknown task fails here, with the known ones named
    try:
        return _TRAINING[task.name]
    except KeyError:
        raise ValueError(f"the {task.name} task has no training implementation") from None
