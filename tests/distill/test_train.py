from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distill.frames import FrameSet
from distill.train import TrainConfig, distillation_loss, soften, train
from shared.errors import DataError, ModelError


def test_soften_recovers_tempered_teacher_distribution() -> None:
    logits = torch.randn(5, 10)
    probs = torch.softmax(logits, 1)
    torch.testing.assert_close(soften(probs, 4.0), torch.softmax(logits / 4.0, 1))
    torch.testing.assert_close(soften(probs, 1.0), probs)


def test_loss_is_cross_entropy_without_teacher() -> None:
    logits, labels = torch.randn(8, 10), torch.randint(0, 10, (8,))
    loss = distillation_loss(logits, labels, None, temperature=4.0, alpha=0.7)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))


def test_distillation_loss_formula() -> None:
    logits, labels = torch.randn(8, 10), torch.randint(0, 10, (8,))
    teacher = torch.softmax(torch.randn(8, 10), 1)
    t, a = 3.0, 0.6
    kl = F.kl_div(F.log_softmax(logits / t, 1), soften(teacher, t), reduction="batchmean")
    expected = a * t * t * kl + (1 - a) * F.cross_entropy(logits, labels)
    got = distillation_loss(logits, labels, teacher, temperature=t, alpha=a)
    torch.testing.assert_close(got, expected)
    # Only the hard term at alpha 0; a student equal to the teacher has zero KL.
    torch.testing.assert_close(
        distillation_loss(logits, labels, teacher, temperature=t, alpha=0.0),
        F.cross_entropy(logits, labels),
    )
    same = distillation_loss(torch.log(teacher), labels, teacher, temperature=t, alpha=1.0)
    assert float(same) == pytest.approx(0.0, abs=1e-5)


def _tiny(test_set: FrameSet) -> FrameSet:
    return test_set.subset(slice(0, 96))


def test_training_is_deterministic_given_seed(small_test_set: FrameSet) -> None:
    data = _tiny(small_test_set)
    cfg = TrainConfig(role="student", epochs=1, batch_size=32, augment_drift=True, p_clean=0.5)
    soft = np.full((len(data), 10), 0.1, dtype=np.float32)
    a = train(cfg, data, data, soft_targets=soft, progress=False)
    b = train(cfg, data, data, soft_targets=soft, progress=False)
    c = train(TrainConfig(role="student", epochs=1, batch_size=32, seed=1), data, progress=False)
    for (name, pa), pb in zip(a.net.state_dict().items(), b.net.state_dict().values(), strict=True):
        torch.testing.assert_close(pa, pb, msg=name)
    assert not torch.equal(a.net.features[0][0].weight, c.net.features[0][0].weight)
    assert a.metrics["distilled"] is True and c.metrics["distilled"] is False
    assert len(a.history) == 1 and "val_acc_drift" in a.history[0]


def test_training_learns(small_test_set: FrameSet) -> None:
    cfg = TrainConfig(role="student", epochs=8, batch_size=32, lr=5e-3)
    result = train(cfg, small_test_set, small_test_set, progress=False)
    assert result.metrics["val_acc"] > 0.5  # chance is 0.1
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_bad_inputs_are_refused(small_test_set: FrameSet) -> None:
    with pytest.raises(DataError, match="frame"):
        train(TrainConfig(frame_size=32, epochs=1), small_test_set, progress=False)
    with pytest.raises(DataError, match="teacher scores"):
        train(
            TrainConfig(epochs=1),
            small_test_set,
            soft_targets=np.zeros((3, 10), np.float32),
            progress=False,
        )
    with pytest.raises(ModelError):
        TrainConfig(role="critic")  # type: ignore[arg-type]
    with pytest.raises(ModelError):
        TrainConfig(epochs=0)
    assert TrainConfig(role="teacher").arch == "teacher-cnn"
    assert "threads" not in TrainConfig().cache_fields()
