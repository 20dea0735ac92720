"""The training side of the task contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distill.tasks import CLASSIFICATION_TRAINING, TrainingTask, training_for
from distill.train import distillation_loss


def test_classification_is_the_default_training_task() -> None:
    assert isinstance(CLASSIFICATION_TRAINING, TrainingTask)
    assert training_for(None) is CLASSIFICATION_TRAINING
    assert training_for("classification").gate_metric == "top1_accuracy"
    with pytest.raises(ValueError, match="unknown task"):
        training_for("segmentation")


def test_the_loss_is_cross_entropy_alone_without_a_teacher_and_kd_with_one() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    labels = torch.tensor([0, 1])
    plain = CLASSIFICATION_TRAINING.loss(logits, labels, None, temperature=4.0, alpha=0.7)
    assert plain == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item())
    teacher = torch.softmax(logits, dim=1)  # a teacher that agrees: only the CE share is left
    kd = CLASSIFICATION_TRAINING.loss(logits, labels, teacher, temperature=1.0, alpha=0.7)
    assert kd.item() == pytest.approx(0.3 * plain.item(), abs=1e-5)
    same = distillation_loss(logits, labels, teacher, temperature=1.0, alpha=0.7)
    assert same.item() == pytest.approx(kd.item())


def test_hits_count_top1() -> None:
    scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    assert CLASSIFICATION_TRAINING.hits(scores, np.array([0, 1, 1])).tolist() == [
        True,
        True,
        False,
    ]
