from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from distill.datasets import (
    FOLDER_SPLITS,
    folder_split_of,
    load_data,
    load_image_folder,
    write_image_folder,
)
from distill.frames import FrameSet
from distill.scenario import ScenarioConfig
from shared.errors import DataError


def _image(path: Path, size: tuple[int, int], mode: str = "RGB", value: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, 50, 200)[: len(mode)]).save(path)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    _image(root / "cat" / "a.png", (40, 30))
    _image(root / "cat" / "b.jpg", (100, 100))
    _image(root / "cat" / "nested" / "c.png", (64, 64), mode="L")
    _image(root / "dog" / "d.png", (20, 80), mode="RGBA")
    _image(root / "dog" / "e.bmp", (64, 64))
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # corrupt
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "dog" / ".DS_Store").write_bytes(b"\0\1")  # hidden: ignored, not counted
    (root / "README.md").write_text("files at the root are not in a class")
    return root


def test_folder_loads_classes_and_skips_unreadable(folder: Path) -> None:
    loaded = load_image_folder(folder, frame_size=32)
    fs = loaded.frames
    assert fs.class_names == ("cat", "dog")
    assert fs.frames.shape == (5, 32, 32, 3) and fs.frames.dtype == np.uint8
    assert fs.class_counts() == {"cat": 3, "dog": 2}
    assert loaded.skipped_count == 2
    assert {s.path.name for s in loaded.skipped} == {"broken.png", "notes.txt"}
    assert "skipped 2 unreadable" in loaded.describe()
    assert fs.masks is None


def test_grayscale_and_alpha_images_become_rgb(folder: Path) -> None:
    fs = load_image_folder(folder, frame_size=16).frames
    gray = fs.frames[fs.labels == 0][-1]  # cat/nested/c.png (mode L, value 100)
    assert (gray == 100).all()


def test_empty_folder_is_refused_with_the_expected_layout(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no class subfolders.*ROOT/<class name>/<image files>"):
        load_image_folder(tmp_path / "empty", frame_size=32)


def test_images_without_class_folders_are_refused(tmp_path: Path) -> None:
    _image(tmp_path / "flat" / "a.png", (10, 10))
    with pytest.raises(DataError, match="no class subfolders"):
        load_image_folder(tmp_path / "flat", frame_size=32)


def test_class_folders_without_readable_images_are_refused(tmp_path: Path) -> None:
    (tmp_path / "bad" / "x").mkdir(parents=True)
    (tmp_path / "bad" / "x" / "junk.jpg").write_bytes(b"junk")
    with pytest.raises(DataError, match=r"no readable images \(1 file\(s\) could not be read\)"):
        load_image_folder(tmp_path / "bad", frame_size=32)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such folder"):
        load_data(tmp_path / "nope", frame_size=32)


def test_folder_splits_are_stable_and_disjoint(tmp_path: Path, small_test_set: FrameSet) -> None:
    root = tmp_path / "digits"
    write_image_folder(small_test_set.subset(slice(0, 60)), root)
    parts = {s: load_image_folder(root, frame_size=64, split=s).frames for s in FOLDER_SPLITS}
    assert sum(len(parts[s]) for s in ("train", "validation", "test")) == len(parts["all"]) == 60
    assert len(parts["train"]) > len(parts["test"])
    # Lossless round trip: PNG frames come back identical at the same size.
    np.testing.assert_array_equal(
        np.sort(parts["all"].frames, axis=0), np.sort(small_test_set.frames[:60], axis=0)
    )
    assert folder_split_of("3/00001.png") == folder_split_of("3/00001.png")
    with pytest.raises(DataError, match="unknown split"):
        load_image_folder(root, frame_size=64, split="stream")


def test_load_data_digits(quick_scenario: ScenarioConfig, quick_test_set: FrameSet) -> None:
    loaded = load_data("digits", split="validation", frame_size=64, scenario=quick_scenario)
    assert loaded.split == "validation" and loaded.source == "digits"
    assert len(loaded.frames) > 0 and loaded.frames.frame_size == 64
    default = load_data("digits", frame_size=64, scenario=quick_scenario)
    assert default.split == "test" and default.frames is quick_test_set
    with pytest.raises(DataError, match="unknown split"):
        load_data("digits", split="all", frame_size=64)
    with pytest.raises(DataError, match="px"):
        load_data("digits", frame_size=32, scenario=quick_scenario)
