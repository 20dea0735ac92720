"""Detection datasets in COCO JSON, YOLO txt and Label Studio JSON: round trips, checks, errors."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import distill.detection_formats as formats
from distill.detection_formats import (
    load_coco,
    load_detection_folder,
    load_yolo,
    predictions_from_fractions,
    write_coco,
    write_labelstudio,
    write_yolo,
)
from distill.scenes import DetectionSet, SceneConfig, render_scenes
from shared.errors import DataError


@pytest.fixture(scope="module")
def scenes() -> DetectionSet:
    """Six rendered frames of 160 px, the first emptied so an empty frame travels too."""
    ds = render_scenes("test", SceneConfig(frame_size=160, eval_frames=6))
    boxes, classes = list(ds.boxes), list(ds.classes)
    boxes[0], classes[0] = np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
    return DetectionSet(ds.frames, boxes, classes, ds.class_names, identity="six")


def _same_boxes(a: DetectionSet, b: DetectionSet, tolerance: float = 1.0) -> None:
    assert len(a) == len(b) and a.class_names == b.class_names
    assert np.array_equal(a.frames, b.frames)  # PNG is lossless
    for i in range(len(a)):
        assert b.boxes[i].shape == a.boxes[i].shape and b.boxes[i].dtype == np.float32
        assert np.abs(a.boxes[i] - b.boxes[i]).max(initial=0.0) <= tolerance
        assert np.array_equal(a.classes[i], b.classes[i])


def _image(path: Path, size: tuple[int, int] = (40, 40), colour: Any = (90, 90, 90)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _coco(root: Path, **changes: Any) -> Path:
    """Two 40x40 images, categories 7 ('cat') and 3 ('dog') listed out of id order."""
    _image(root / "images" / "a.png")
    _image(root / "images" / "b.png")
    doc: dict[str, Any] = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 40, "height": 40},
            {"id": 2, "file_name": "b.png", "width": 40, "height": 40},
        ],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 7, "bbox": [2, 3, 10, 12], "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 3, "bbox": [30, 30, 20, 5]},  # off the edge
            {"id": 3, "image_id": 2, "category_id": 3, "bbox": [0, 0, 40, 40], "iscrowd": 1},
            {"id": 4, "image_id": 2, "category_id": 7, "bbox": [5, 5, 0, 8]},  # no width
        ],
        "categories": [{"id": 7, "name": "cat"}, {"id": 3, "name": "dog"}],
    }
    doc.update(changes)
    path = root / "annotations.json"
    path.write_text(json.dumps(doc))
    return path


def _yolo(root: Path, labels: dict[str, str], names: str = "names: [cat, dog]\n") -> Path:
    for stem in ("a", "b", "c"):
        _image(root / "images" / f"{stem}.png")
    for stem, text in labels.items():
        (root / "labels").mkdir(parents=True, exist_ok=True)
        (root / "labels" / f"{stem}.txt").write_text(text)
    (root / "data.yaml").write_text(names)
    return root


def test_coco_round_trip(scenes: DetectionSet, tmp_path: Path) -> None:
    written = write_coco(scenes, tmp_path)
    back = load_coco(written.annotations, tmp_path / "images")
    _same_boxes(scenes, back)
    assert back.notes["format"] == "coco" and back.notes["dropped_boxes"] == 0
    assert back.notes["files"] == tuple(f.name for f in written.images)


def test_coco_categories_crowd_clipping_and_degenerate_boxes(tmp_path: Path) -> None:
    ds = load_coco(_coco(tmp_path), tmp_path / "images")
    assert ds.class_names == ("dog", "cat")  # sorted ids 3, 7
    assert np.array_equal(ds.classes[0], [1, 0])
    assert np.array_equal(ds.boxes[0], [[2, 3, 12, 15], [30, 30, 40, 35]])  # clipped
    assert len(ds.boxes[1]) == 0  # the crowd region skipped, the empty box dropped
    assert ds.notes["crowd_skipped"] == 1 and ds.notes["dropped_boxes"] == 1
    assert ds.notes["category_ids"] == (3, 7)


def _coco_eval(gt_path: Path, detections: Any) -> float:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", DeprecationWarning)  # pycocotools vs NumPy 2
        truth = COCO(str(gt_path))
        evaluation = COCOeval(truth, truth.loadRes(detections), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[0])


def test_coco_export_loads_in_pycocotools_and_scores_itself_perfectly(
    scenes: DetectionSet, tmp_path: Path
) -> None:
    from pycocotools.coco import COCO

    truth = [
        [(box, 1.0, int(c)) for box, c in zip(b, k, strict=True)]
        for b, k in zip(scenes.boxes, scenes.classes, strict=True)
    ]
    written = write_coco(scenes, tmp_path, predictions=truth)
    assert written.predictions is not None
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(written.annotations))
    assert len(coco.getImgIds()) == 6
    assert len(coco.getAnnIds()) == sum(len(c) for c in scenes.classes)
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(scenes.class_names)
    first = coco.loadAnns(coco.getAnnIds(imgIds=[2]))[0]
    x1, y1, x2, y2 = scenes.boxes[1][0]
    assert first["bbox"] == pytest.approx([x1, y1, x2 - x1, y2 - y1])
    assert _coco_eval(written.annotations, str(written.predictions)) == pytest.approx(1.0)
    # The ground truth as detections, straight from the annotation file, scores 1.0 too.
    own = json.loads(written.annotations.read_text())["annotations"]
    dets = [{**a, "score": 1.0} for a in own]
    assert _coco_eval(written.annotations, dets) == pytest.approx(1.0)


def test_yolo_round_trip_with_an_empty_frame(scenes: DetectionSet, tmp_path: Path) -> None:
    write_yolo(scenes, tmp_path)
    assert (tmp_path / "labels" / "000000.txt").read_text() == ""  # an empty frame's file
    back = load_yolo(tmp_path)
    _same_boxes(scenes, back, tolerance=0.01)
    assert len(back.boxes[0]) == 0
    assert back.notes["format"] == "yolo"


def test_yolo_missing_label_file_polygons_and_names(tmp_path: Path) -> None:
    root = _yolo(tmp_path, {"a": "1 0.5 0.5 0.5 0.25\n\n", "b": "0 0.1 0.1 0.3 0.1 0.2 0.4\n"})
    ds = load_yolo(root)
    assert ds.class_names == ("cat", "dog")
    assert np.allclose(ds.boxes[0], [[10, 15, 30, 25]]) and ds.classes[0].tolist() == [1]
    assert np.allclose(ds.boxes[1], [[4, 4, 12, 16]])  # the polygon's bounding box
    assert len(ds.boxes[2]) == 0 and ds.notes["unlabelled_images"] == 1


@pytest.mark.parametrize(
    "names",
    [
        "nc: 2\nnames:\n  0: cat\n  1: 'dog'\n",
        'names:\n  - cat\n  - "dog"  # a comment\ntrain: images\n',
        "path: .\nnames: ['cat', \"dog\"]\n",
    ],
)
@pytest.mark.parametrize("pyyaml", [True, False])
def test_yolo_names_from_data_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: str, pyyaml: bool
) -> None:
    if not pyyaml:
        monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml fails: the own parser
    assert load_yolo(_yolo(tmp_path, {}, names)).class_names == ("cat", "dog")


def test_yolo_names_from_classes_txt(tmp_path: Path) -> None:
    root = _yolo(tmp_path, {"a": "1 0.5 0.5 0.2 0.2\n"})
    (root / "data.yaml").unlink()
    (root / "classes.txt").write_text("cat\ndog\n")
    assert load_yolo(root).class_names == ("cat", "dog")


def test_label_studio_tasks(scenes: DetectionSet, tmp_path: Path) -> None:
    predictions: list[list[formats.Prediction]] = [[] for _ in range(len(scenes))]
    predictions[1] = [((16.0, 32.0, 48.0, 80.0), 0.8, 3), ((0.0, 0.0, 8.0, 8.0), 0.4, 5)]
    written = write_labelstudio(
        scenes, tmp_path, predictions=predictions, model_version="student:7", image_prefix="/x/"
    )
    tasks = json.loads(written.annotations.read_text())
    assert len(tasks) == 6 and tasks[1]["data"]["image"] == "/x/images/000001.png"
    assert (tmp_path / "images" / "000001.png").is_file()
    truth = tasks[1]["annotations"][0]["result"]
    assert len(truth) == len(scenes.boxes[1]) and tasks[0]["annotations"][0]["result"] == []
    x1, y1, x2, y2 = (float(v) for v in scenes.boxes[1][0])
    region = truth[0]
    assert region["from_name"] == "label" and region["to_name"] == "image"
    assert region["type"] == "rectanglelabels"
    assert region["original_width"] == region["original_height"] == 160
    assert region["value"]["x"] == pytest.approx(x1 / 1.6, abs=1e-3)
    assert region["value"]["y"] == pytest.approx(y1 / 1.6, abs=1e-3)
    assert region["value"]["width"] == pytest.approx((x2 - x1) / 1.6, abs=1e-3)
    assert region["value"]["height"] == pytest.approx((y2 - y1) / 1.6, abs=1e-3)
    assert region["value"]["rectanglelabels"] == [scenes.class_names[int(scenes.classes[1][0])]]
    (prediction,) = tasks[1]["predictions"]
    assert prediction["model_version"] == "student:7"
    assert prediction["score"] == pytest.approx(0.6)
    boxes = prediction["result"]
    assert [r["score"] for r in boxes] == [0.8, 0.4]
    assert boxes[0]["value"] == {
        "x": 10.0, "y": 20.0, "width": 20.0, "height": 30.0, "rotation": 0.0,
        "rectanglelabels": ["3"],
    }  # fmt: skip
    assert tasks[0]["predictions"][0]["result"] == [] and tasks[0]["predictions"][0]["score"] == 1
    ids = [
        r["id"]
        for t in tasks
        for r in t["annotations"][0]["result"] + t["predictions"][0]["result"]
    ]
    assert len(ids) == len(set(ids))
    config = (tmp_path / "labeling_config.xml").read_text()
    assert '<RectangleLabels name="label" toName="image">' in config and 'value="9"' in config
    bare = write_labelstudio(scenes, tmp_path / "bare", include_annotations=False)
    assert all("annotations" not in t for t in json.loads(bare.annotations.read_text()))


def test_predictions_from_fractions() -> None:
    rows = [np.array([[0.1, 0.2, 0.5, 0.6, 0.9, 2], [0, 0, 0, 0, 0, 0]]), np.zeros((0, 6))]
    (first,), empty = predictions_from_fractions(rows, 100)
    assert np.allclose(first[0], [10, 20, 50, 60]) and first[1:] == (0.9, 2)
    assert empty == []


def test_layout_detection(scenes: DetectionSet, tmp_path: Path) -> None:
    write_yolo(scenes, tmp_path / "yolo")
    write_coco(scenes, tmp_path / "coco")
    assert load_detection_folder(tmp_path / "yolo").notes["format"] == "yolo"
    assert load_detection_folder(tmp_path / "coco").notes["format"] == "coco"
    assert load_detection_folder(tmp_path / "coco" / "annotations.json", 80).frame_size == 80
    nested = tmp_path / "nested"
    (nested / "annotations").mkdir(parents=True)
    (tmp_path / "coco" / "images").rename(nested / "images")
    (tmp_path / "coco" / "annotations.json").rename(nested / "annotations" / "train.json")
    _same_boxes(scenes, load_detection_folder(nested))
    write_labelstudio(scenes, tmp_path / "ls")  # tasks.json is no COCO file
    with pytest.raises(DataError, match=r"neither a COCO nor a YOLO.*accepted layouts: COCO"):
        load_detection_folder(tmp_path / "ls")
    with pytest.raises(DataError, match="no such folder"):
        load_detection_folder(tmp_path / "absent")
    (nested / "annotations" / "val.json").write_text('{"images": []}')
    with pytest.raises(DataError, match="several COCO JSON files"):
        load_detection_folder(nested)
    (tmp_path / "yolo" / "extra.json").write_text('{"images": []}')
    with pytest.raises(DataError, match="both a YOLO dataset and COCO JSON"):
        load_detection_folder(tmp_path / "yolo")


def test_resizing_scales_boxes_per_axis(tmp_path: Path) -> None:
    image = Image.new("RGB", (200, 100), (0, 0, 0))
    image.paste((255, 0, 0), (20, 10, 60, 50))
    image.save(tmp_path / "wide.png")
    doc = {
        "images": [{"id": 5, "file_name": "wide.png", "width": 200, "height": 100}],
        "annotations": [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [20, 10, 40, 40]}],
        "categories": [{"id": 1, "name": "box"}],
    }
    (tmp_path / "a.json").write_text(json.dumps(doc))
    ds = load_coco(tmp_path / "a.json", tmp_path, size=50)
    assert ds.frames.shape == (1, 50, 50, 3)
    assert np.allclose(ds.boxes[0], [[5, 5, 15, 25]])  # x / 4, y / 2: a plain resize
    assert ds.frames[0, 15, 10, 0] > 200 and ds.frames[0, 40, 40, 0] < 50
    with pytest.raises(DataError, match=r"200x100.*pass size="):
        load_coco(tmp_path / "a.json", tmp_path)  # not square, no size


def test_exif_orientation_follows_the_annotations(tmp_path: Path) -> None:
    raw = np.zeros((20, 40, 3), np.uint8)
    raw[:, :20] = 255  # left half white as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise: 20 wide, 40 high
    Image.fromarray(raw).save(tmp_path / "r.jpg", exif=exif, quality=100)
    for (w, h), white_top in [((20, 40), True), ((40, 20), False)]:
        doc = {
            "images": [{"id": 1, "file_name": "r.jpg", "width": w, "height": h}],
            "annotations": [],
            "categories": [{"id": 1, "name": "x"}],
        }
        (tmp_path / "a.json").write_text(json.dumps(doc))
        frame = load_coco(tmp_path / "a.json", tmp_path, size=40).frames[0]
        assert (frame[5, 20, 0] > 200) == white_top  # upright, the white half is on top
        assert (frame[20, 5, 0] > 200) == (not white_top)


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(DataError) as info:
        call(*args, **kwargs)
    return str(info.value)


def test_malformed_coco_is_refused_with_the_file_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = tmp_path / "images"
    path = _coco(tmp_path)
    ann = {"id": 9, "image_id": 1, "category_id": 7, "bbox": [1, 1, 2, 2]}
    alone: dict[str, Any] = {"annotations": []}  # so that only the images are wrong
    cases: list[tuple[dict[str, Any], str]] = [
        ({"annotations": [{**ann, "category_id": 99}]}, r"unknown category id 99 \(known: 3, 7\)"),
        ({"annotations": [{**ann, "image_id": 5}]}, "image id 5, which 'images' lacks"),
        ({"annotations": [{**ann, "bbox": [1, 2, 3]}]}, r"annotations\[0\]\.bbox must be 4"),
        ({"annotations": [{**ann, "category_id": "7"}]}, "category_id must be an integer"),
        ({**alone, "images": [{"id": 1, "file_name": "gone.png"}]}, "1 image.*'gone.png'"),
        ({**alone, "images": [{"id": 1}]}, r"images\[0\]\.file_name must be a non-empty str"),
        ({**alone, "images": [{"id": 1, "file_name": "a.png", "width": 3, "height": 4}]}, "3x4"),
        ({**alone, "images": [{"id": 1.5, "file_name": "a.png"}]}, "id must be an integer"),
        ({"categories": []}, "has no categories"),
        ({"categories": [{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]}, "id 1 appears twice"),
        ({"annotations": [ann] * 301}, "over 300 boxes"),
        ({"annotations": {}}, "is not COCO JSON"),
    ]
    for changes, message in cases:
        text = _error(load_coco, _coco(tmp_path, **changes), images)
        assert str(path) in text and re.search(message, text), (message, text)
    (tmp_path / "notes.txt").write_text("hello")
    (images / "bad.png").write_bytes(b"not a png")
    for name, message in [("notes.txt", "not an image file; accepted"), ("bad.png", "decode")]:
        path = _coco(tmp_path, annotations=[], images=[{"id": 1, "file_name": name}])
        folder = tmp_path if name == "notes.txt" else images
        assert message in _error(load_coco, path, folder)
    path.write_text("{ not json")
    assert f"cannot read {path} as JSON" in _error(load_coco, path, images)
    assert "no such image folder" in _error(load_coco, _coco(tmp_path), tmp_path / "nope")
    assert "size must be" in _error(load_coco, _coco(tmp_path), images, size=0)
    monkeypatch.setattr(formats, "MAX_IMAGES", 1)
    assert "lists 2 images; 1 to 1 are read" in _error(load_coco, _coco(tmp_path), images)


def test_malformed_yolo_is_refused_with_the_file_and_line_named(tmp_path: Path) -> None:
    cases = [
        ("0 0.5 0.5", "a.txt line 1 ('0 0.5 0.5') is not 'class cx cy w h'"),
        ("0 0.5 0.5 0.1 0.1\ncat 0.5 0.5 0.1 0.1", "a.txt line 2"),
        ("2 0.5 0.5 0.1 0.1", "class 2 is not a class index 0..1"),
        ("nan 0.5 0.5 0.1 0.1", "class nan is not a class index"),
        ("0 20 30 10 10", "must be normalised to 0..1"),
        ("0 0.5 0.5 0.1 nan", "is not 'class cx cy w h'"),
        ("0 0.5 0.5 0.1 0.1\n" * 301, "over 300 boxes"),
    ]
    for i, (label, message) in enumerate(cases):
        root = _yolo(tmp_path / str(i), {"a": label})
        text = _error(load_yolo, root)
        assert message in text and str(root / "labels" / "a.txt") in text
    root = _yolo(tmp_path / "names", {}, names="train: images\n")
    assert "data.yaml has no 'names' list" in _error(load_yolo, root)
    (root / "data.yaml").write_text("nc: 3\nnames: [a, b]\n")
    assert "nc is 3 but names lists 2" in _error(load_yolo, root)
    (root / "data.yaml").write_text("names: {0: a, 2: b}\n")
    assert "names ids must be 0..1" in _error(load_yolo, root)
    (root / "data.yaml").write_text("names: [a\n")
    assert "cannot read" in _error(load_yolo, root)
    (root / "data.yaml").unlink()
    assert "no data.yaml or classes.txt" in _error(load_yolo, root)
    (root / "classes.txt").write_text("a\n\nb\n")
    assert "no blank lines" in _error(load_yolo, root)
    (root / "classes.txt").write_text("a\nb\n")
    (root / "images" / "readme.md").write_text("# my images")
    assert f"{root / 'images' / 'readme.md'} is not an image file" in _error(load_yolo, root)
    assert "no such folder" in _error(load_yolo, tmp_path / "absent")


def test_writers_check_predictions(scenes: DetectionSet, tmp_path: Path) -> None:
    assert "predictions has 1 frames" in _error(write_coco, scenes, tmp_path, predictions=[[]])
    bad: list[list[formats.Prediction]] = [[] for _ in range(6)]
    bad[2] = [((0.0, 0.0, 5.0, 5.0), 0.5, 10)]
    assert "frame 2: predicted class 10" in _error(
        write_labelstudio, scenes, tmp_path, predictions=bad
    )
    bad[2] = [((0.0, 0.0, 5.0), 0.5, 1)]
    assert "4 finite corners" in _error(write_coco, scenes, tmp_path, predictions=bad)
