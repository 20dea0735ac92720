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
    first_a = next(m for m in a.net.modules() if isinstance(m, torch.nn.Conv2d))
    first_c = next(m for m in c.net.modules() if isinstance(m, torch.nn.Conv2d))
    assert not torch.equal(first_a.weight, first_c.weight)
    assert a.metrics["distilled"] is True and c.metrics["distilled"] is False
    assert len(a.history) == 1 and "val_acc_drift" in a.history[0]


def test_training_learns(small_test_set: FrameSet) -> None:
    cfg = TrainConfig(role="student", epochs=8, batch_size=32, lr=5e-3)
    result = train(cfg, small_test_set, small_test_set, progress=False)
    assert result.metrics["val_acc"] > 0.5  # chance is 0.1
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_keep_last_keeps_the_annealed_weights_whatever_validation_says(
    small_test_set: FrameSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    import distill.train as train_module

    data = _tiny(small_test_set)
    cfg = TrainConfig(role="student", epochs=3, batch_size=32, lr=5e-3)

    # Validation that scores every epoch worse than the one before: by validation the
    # first epoch is best, and patience 1 stops after the second.
    def falling() -> None:
        scores = iter([0.9, 0.5, 0.2])
        monkeypatch.setattr(train_module, "evaluate_net", lambda *args: next(scores))

    falling()
    best = train(cfg, data, data, progress=False, patience=1)
    assert best.metrics["best_epoch"] == 1 and len(best.history) == 2
    falling()
    last = train(cfg, data, data, progress=False, patience=1, keep_last=True)
    assert last.metrics["best_epoch"] == 3 and len(last.history) == 3


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


def test_temperature_scaling_recovers_and_folds_a_known_temperature() -> None:
    from distill.models import build_model
    from distill.train import fit_temperature, fold_temperature, net_logits

    torch.manual_seed(0)
    net = build_model("student-cnn", 10)
    last = [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():  # spread the random net's logits so labels depend on them
        last.weight.mul_(30.0)
        last.bias.mul_(30.0)
    frames = np.random.default_rng(0).integers(0, 255, (600, 64, 64, 3), dtype=np.uint8)
    logits = net_logits(net, frames)
    # Labels drawn from softmax(logits / 2): the honest temperature is 2.
    probs = torch.softmax(logits / 2.0, 1).double().numpy()
    draw = np.random.default_rng(1)
    labels = np.array([draw.choice(10, p=p / p.sum()) for p in probs])
    t = fit_temperature(net, frames, labels)
    assert 1.5 < t < 2.7
    fold_temperature(net, t)
    folded = net_logits(net, frames)
    torch.testing.assert_close(folded, logits / t, rtol=1e-4, atol=1e-4)
    assert torch.equal(folded.argmax(1), logits.argmax(1))  # predictions never change
    assert fit_temperature(net, frames[:0], labels[:0]) == 1.0


def test_random_shift_moves_frames_and_keeps_their_pixels() -> None:
    from distill.train import random_shift

    frames = np.random.default_rng(0).integers(0, 255, (16, 64, 64, 3), dtype=np.uint8)
    rng = np.random.default_rng(1)
    np.testing.assert_array_equal(random_shift(frames, rng, max_px=0), frames)
    moved = random_shift(frames, rng, max_px=4)
    assert moved.shape == frames.shape and moved.dtype == np.uint8
    assert not np.array_equal(moved, frames)
    # The centre of each frame is still in view, moved by at most 4 pixels.
    for a, b in zip(frames, moved, strict=True):
        assert any(
            np.array_equal(a[8:56, 8:56], b[8 + dy : 56 + dy, 8 + dx : 56 + dx])
            for dy in range(-4, 5)
            for dx in range(-4, 5)
        )


def test_validation_nll_ranks_a_network_by_its_true_label_likelihood() -> None:
    from distill.models import build_model
    from distill.train import net_logits, validation_nll

    torch.manual_seed(0)
    net = build_model("student-cnn", 10)
    frames = np.random.default_rng(2).integers(0, 255, (64, 64, 64, 3), dtype=np.uint8)
    predicted = net_logits(net, frames).argmax(1).numpy()
    own = validation_nll(net, frames, predicted)  # labels the net already favours
    other = validation_nll(net, frames, (predicted + 1) % 10)
    assert 0.0 < own < other
    expected = F.cross_entropy(net_logits(net, frames), torch.as_tensor(predicted)).item()
    assert own == pytest.approx(expected, rel=1e-6)
    assert validation_nll(net, frames[:0], predicted[:0]) == 0.0
