"""quantize reports accuracy on frames it did not calibrate on, and says which."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from distill.quantize import quantization_frames
from shared.errors import DataError


def _folder(root: Path, splits: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for split, n in splits.items():
        for cls in ("a", "b"):
            for i in range(n):
                path = root / split / cls / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(path)
    return root


def _pixels(frames: np.ndarray) -> set[bytes]:
    return {f.tobytes() for f in frames}


def test_a_dataset_calibrates_on_train_and_reports_on_test(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", {"train": 4, "val": 2, "test": 3})
    frames = quantization_frames(str(root), frame_size=8)
    assert (frames.calibration.split, frames.selection.split, frames.held_out.split) == (
        "train",
        "validation",
        "test",
    )
    assert len(frames.held_out.frames) == 6
    assert not _pixels(frames.calibration.frames.frames) & _pixels(frames.held_out.frames.frames)
    assert frames.note == (
        f"test split of {root} (6 frames, held out; calibrated on its train split, 8 frames)"
    )


def test_without_a_test_split_the_validation_split_is_held_out(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", {"train": 3, "val": 2})
    frames = quantization_frames(str(root), frame_size=8)
    assert frames.held_out.split == "validation" and frames.selection is frames.held_out


def test_a_dataset_with_one_split_is_refused_with_its_counts(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", {"train": 3})
    with pytest.raises(DataError, match=r"frames per split: train 6, validation 0, test 0"):
        quantization_frames(str(root), frame_size=8)
