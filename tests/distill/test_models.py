from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distill.models import (
    FramesModel,
    ModelMeta,
    StudentNet,
    TeacherNet,
    build_model,
    frames_to_input,
    fuse_conv_bn,
    load_checkpoint,
    model_profile,
    save_checkpoint,
)
from shared.errors import ModelError


def _warmed(net: torch.nn.Module) -> torch.nn.Module:
    """Give BatchNorm non-trivial running statistics, then switch to eval."""
    torch.manual_seed(0)
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 3, 64, 64))
    return net.eval()


def test_student_profile_counts_params_and_macs() -> None:
    prof = model_profile(StudentNet(10), 64)
    assert prof["params"] == sum(p.numel() for p in StudentNet(10).parameters())
    # Stem 8x8/8: 64 positions x (3*8*8) x 64; 1x1 64->128 at 8x8; 3x3/2 128->128 at 4x4;
    # 1x1 128->256 at 4x4; linear 256->10.
    expected = 64 * 192 * 64 + 64 * 64 * 128 + 16 * 128 * 9 * 128 + 16 * 128 * 256 + 256 * 10
    assert prof["macs"] == expected
    assert prof["flops"] == 2 * expected
    assert [layer["type"] for layer in prof["layers"]] == ["Conv2d"] * 4 + ["Linear"]


def test_teacher_is_much_larger_than_student() -> None:
    t, s = model_profile(TeacherNet(10), 64), model_profile(StudentNet(10), 64)
    assert t["macs"] > 5 * s["macs"]
    assert t["params"] > 4 * s["params"]


@pytest.mark.parametrize("arch", ["teacher-cnn", "student-cnn"])
def test_fused_model_matches_unfused(arch: str) -> None:
    net = _warmed(build_model(arch, 10))
    fused = fuse_conv_bn(net)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    x = torch.randn(4, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), net(x), atol=1e-4, rtol=1e-4)


def test_frames_model_takes_uint8_nhwc_and_returns_probabilities() -> None:
    net = _warmed(StudentNet(10))
    frames = np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    with torch.inference_mode():
        probs = FramesModel(net)(torch.from_numpy(frames))
        logits = net(frames_to_input(frames))
    assert probs.shape == (3, 10)
    torch.testing.assert_close(probs.sum(1), torch.ones(3))
    torch.testing.assert_close(probs, torch.softmax(logits, 1))


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    net = _warmed(StudentNet(3, width=0.5))
    meta = ModelMeta(
        arch="student-cnn",
        num_classes=3,
        class_names=("a", "b", "c"),
        frame_size=64,
        width=0.5,
        name="n",
        version="v1",
        train_config={"epochs": 2},
        metrics={"val_acc": 0.5},
    )
    save_checkpoint(tmp_path / "m.pt", net, meta)
    loaded = load_checkpoint(tmp_path / "m.pt")
    assert loaded.meta == meta
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.net(x), net(x))


def test_bad_checkpoints_raise_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ModelError, match="not an EdgeLoop checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_build_model_refuses_unknown_arch() -> None:
    with pytest.raises(ModelError, match="unknown architecture"):
        build_model("resnet", 10)
    with pytest.raises(ModelError):
        build_model("student-cnn", 1)
