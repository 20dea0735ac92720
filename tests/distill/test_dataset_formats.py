"""COCO JSON, YOLO txt and the split-folder ImageFolder layout, on small generated datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from distill.datasets import detect_format, load_coco, load_data, load_image_folder, load_yolo
from shared.errors import DataError

# Three classes, each a flat colour, so a loaded frame tells which image it came from.
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def _image(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def _colour_of(frame: np.ndarray) -> str:
    mean = frame.reshape(-1, 3).mean(axis=0)
    return min(COLOURS, key=lambda c: float(np.abs(mean - np.array(COLOURS[c])).sum()))


def _coco(tmp_path: Path) -> Path:
    """Four images: one box; two boxes of one class; two classes (the larger wins); none."""
    names = ["red", "green", "blue"]
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    boxes = {
        "a.png": [("red", [0, 0, 10, 10])],
        "b.png": [("green", [0, 0, 5, 5]), ("green", [5, 5, 5, 5])],
        "c.png": [("red", [0, 0, 4, 4]), ("blue", [2, 2, 20, 20])],
        "d.png": [],
    }
    for i, (name, anns) in enumerate(boxes.items(), 1):
        colour = COLOURS[max(anns, key=lambda a: a[1][2] * a[1][3])[0]] if anns else (0, 0, 0)
        _image(tmp_path / "images" / name, colour)
        images.append({"id": i, "file_name": name, "width": 40, "height": 30})
        for cat, box in anns:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": 10 + names.index(cat),
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    doc = {
        "images": images,
        "annotations": annotations,
        # Out of id order on purpose: classes are the categories in id order.
        "categories": [{"id": 10 + i, "name": n} for i, n in reversed(list(enumerate(names)))],
    }
    path = tmp_path / "annotations" / "instances.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return path


def test_coco_gives_each_image_its_single_or_largest_boxs_category(tmp_path: Path) -> None:
    path = _coco(tmp_path)
    loaded = load_coco(path, frame_size=16)
    fs = loaded.frames
    assert fs.class_names == ("red", "green", "blue") and loaded.format == "coco"
    assert [fs.class_names[i] for i in fs.labels] == ["red", "green", "blue"]
    assert [_colour_of(f) for f in fs.frames] == ["red", "green", "blue"]
    assert [(s.path.name, s.reason) for s in loaded.skipped] == [("d.png", "no annotations")]
    # Detected from the file or from its folder; the pycocotools reader agrees.
    assert detect_format(path) == "coco" and detect_format(tmp_path) == "coco"
    assert load_data(tmp_path, frame_size=16).frames.class_names == fs.class_names
    from pycocotools.coco import COCO

    assert len(COCO(str(path)).getImgIds()) == 4


def test_coco_errors_say_what_is_expected(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"images": []}))
    with pytest.raises(DataError, match=r"is not COCO JSON.*'categories'"):
        load_coco(bad, frame_size=16)
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read .* as JSON"):
        load_data(bad, frame_size=16)


def _yolo(root: Path, *, names: str) -> None:
    """images/{train,val}/ with labels/ mirrored: the largest box's class is the image's."""
    rows = {
        "train/a.png": ("red", "0 0.5 0.5 0.4 0.4\n2 0.5 0.5 0.1 0.1\n"),
        "train/b.png": ("blue", "0 0.2 0.2 0.1 0.1\n2 0.5 0.5 0.8 0.8\n"),
        "train/c.png": ("green", "1 0.1 0.1 0.5 0.1 0.5 0.6 0.1 0.6\n"),  # a polygon
        "val/d.png": ("green", "1 0.5 0.5 0.3 0.3\n"),
        "val/e.png": ("red", ""),  # a background image: skipped
        "val/f.png": ("red", None),  # no label file: skipped
    }
    for rel, (colour, label) in rows.items():
        _image(root / "images" / rel, COLOURS[colour])
        if label is not None:
            txt = (root / "labels" / rel).with_suffix(".txt")
            txt.parent.mkdir(parents=True, exist_ok=True)
            txt.write_text(label)
    if names == "yaml-list":
        (root / "data.yaml").write_text("path: .\ntrain: images/train\nnames: [red, green, blue]\n")
    elif names == "yaml-map":
        (root / "data.yaml").write_text("names:\n  0: red\n  1: green\n  2: blue\n")
    else:
        (root / "classes.txt").write_text("red\ngreen\nblue\n")


@pytest.mark.parametrize("names", ["yaml-list", "yaml-map", "classes.txt"])
def test_yolo_detection_labels_become_the_largest_boxs_class(tmp_path: Path, names: str) -> None:
    _yolo(tmp_path, names=names)
    assert detect_format(tmp_path) == "yolo"
    loaded = load_data(tmp_path, frame_size=16)
    fs = loaded.frames
    assert fs.class_names == ("red", "green", "blue") and loaded.format == "yolo"
    assert [fs.class_names[i] for i in fs.labels] == [_colour_of(f) for f in fs.frames]
    assert sorted(fs.class_names[i] for i in fs.labels) == ["blue", "green", "green", "red"]
    assert sorted(s.reason for s in loaded.skipped) == [
        "no boxes in its label file",
        "no label file",
    ]
    # The split folders are the splits.
    train = load_yolo(tmp_path, frame_size=16, split="train").frames
    val = load_yolo(tmp_path, frame_size=16, split="validation").frames
    assert len(train) == 3 and len(val) == 1
    with pytest.raises(DataError, match="no readable images in split 'test'"):
        load_yolo(tmp_path, frame_size=16, split="test")


def test_yolo_labels_beside_the_images_and_bad_lines(tmp_path: Path) -> None:
    _image(tmp_path / "x.png", COLOURS["blue"])
    (tmp_path / "x.txt").write_text("2 0.5 0.5 0.5 0.5\n")
    _image(tmp_path / "y.png", COLOURS["red"])
    (tmp_path / "y.txt").write_text("7 0.5 0.5 0.5 0.5\n")
    (tmp_path / "classes.txt").write_text("red\ngreen\nblue\n")
    loaded = load_data(tmp_path, frame_size=16, format="yolo")
    assert loaded.frames.labels.tolist() == [2]
    assert [s.reason for s in loaded.skipped] == ["y.txt line 1: class 7 outside 0..2"]
    (tmp_path / "classes.txt").unlink()
    with pytest.raises(DataError, match=r"no data\.yaml or classes\.txt"):
        load_yolo(tmp_path, frame_size=16)


def test_the_classification_layout_uses_its_split_folders(tmp_path: Path) -> None:
    for split, n in (("train", 3), ("val", 2), ("test", 1)):
        for colour in COLOURS:
            for i in range(n):
                _image(tmp_path / split / colour / f"{i}.png", COLOURS[colour])
    assert detect_format(tmp_path) == "imagefolder"
    parts = {
        s: load_image_folder(tmp_path, frame_size=8, split=s).frames
        for s in ("all", "train", "validation", "test")
    }
    assert parts["all"].class_names == ("blue", "green", "red")
    assert [len(parts[s]) for s in ("all", "train", "validation", "test")] == [18, 9, 6, 3]
    assert all(
        parts["all"].class_names[lbl] == _colour_of(f)
        for f, lbl in zip(parts["all"].frames, parts["all"].labels, strict=True)
    )


def test_an_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown data format 'voc'; use one of auto"):
        load_data(tmp_path, frame_size=16, format="voc")
