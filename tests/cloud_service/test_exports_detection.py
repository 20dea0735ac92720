"""A detector's review results as datasets: a box per COCO annotation and YOLO line,
Label Studio rectangles, boxes in the JSON records."""

from __future__ import annotations

import contextlib
import io
import json
import zipfile
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cloud_service.exports import ExportRow, coco, label_studio, write_export
from shared.errors import StoreError

NAMES = tuple(str(d) for d in range(10))
TEACHER = ((0.1, 0.2, 0.3, 0.6, 0.9, 7), (0.5, 0.5, 0.9, 0.8, 0.8, 2))
HUMAN = ((0.1, 0.2, 0.3, 0.6, 1.0, 1),)  # a reviewer changed the class and dropped a box


class Blobs:
    def get(self, key: str) -> bytes:
        if key == "missing":
            raise StoreError("gone")
        return b"\xff\xd8jpeg"


def row(sample_id: str, **changes: object) -> ExportRow:
    base = ExportRow(
        sample_id=sample_id,
        label=7,
        class_name="7",
        source="teacher",
        labeled_by="t-1",
        labeled_at=datetime(2026, 12, 3, tzinfo=UTC),
        status="verified",
        agent_id="cam-1",
        fleet="line-1",
        captured_at=datetime(2026, 12, 3, tzinfo=UTC),
        model_name="student",
        model_version="s-1",
        classes=NAMES,
        edge_label=7,
        edge_confidence=0.5,
        teacher_label=7,
        teacher_confidence=0.85,
        teacher_model="teacher",
        teacher_version="t-1",
        route_reason="mean_score",
        image_key=sample_id,
        image_format="jpeg",
        image_width=320,
        image_height=200,
        boxes=TEACHER,
        edge_boxes=(TEACHER[0],),
        teacher_boxes=TEACHER,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


ROWS = [
    row("a"),
    row("b", source="human", labeled_by="rev", label=1, class_name="1", boxes=HUMAN),
    row("c", boxes=(), teacher_boxes=()),  # an empty frame, confirmed empty
    row("d", status="pending", source=None, label=None, class_name=None, boxes=None),
]


def test_coco_has_an_annotation_per_box_and_loads_in_pycocotools(tmp_path: Path) -> None:
    from pycocotools.coco import COCO

    data = coco(ROWS, image_url=lambda i: f"http://x/{i}")
    assert [i["sample_id"] for i in data["images"]] == ["a", "b", "c"]  # d has no label
    assert data["images"][0]["file_name"] == "images/a.jpg"
    assert len(data["annotations"]) == 3
    first = data["annotations"][0]
    assert first["bbox"] == pytest.approx([32.0, 40.0, 64.0, 80.0])
    names = {c["id"]: c["name"] for c in data["categories"]}
    assert [names[a["category_id"]] for a in data["annotations"]] == ["7", "2", "1"]
    path = tmp_path / "coco.json"
    path.write_text(json.dumps(data))
    with contextlib.redirect_stdout(io.StringIO()):
        loaded = COCO(str(path))
    assert len(loaded.getAnnIds()) == 3 and len(loaded.getImgIds()) == 3


def test_yolo_has_a_line_per_box_and_an_empty_file_for_an_empty_frame() -> None:
    out = io.BytesIO()
    write_export("yolo", ROWS, out, blobs=Blobs(), image_url=str)  # type: ignore[arg-type]
    with zipfile.ZipFile(out) as archive:
        classes = archive.read("classes.txt").decode().split()
        a = archive.read("labels/a.txt").decode().splitlines()
        assert len(a) == 2
        cls, cx, cy, w, h = a[0].split()
        assert classes[int(cls)] == "7"
        assert [float(v) for v in (cx, cy, w, h)] == pytest.approx([0.2, 0.4, 0.2, 0.4])
        assert archive.read("labels/c.txt") == b""
        assert "labels/d.txt" not in archive.namelist()


def test_label_studio_rectangles_for_edge_teacher_and_human() -> None:
    tasks = {t["data"]["sample_id"]: t for t in label_studio(ROWS, image_url=str)}
    a = tasks["a"]
    assert [p["model_version"] for p in a["predictions"]] == ["student:s-1", "teacher:t-1"]
    teacher = a["predictions"][1]["result"]
    assert teacher[0]["type"] == "rectanglelabels"
    assert teacher[0]["value"]["x"] == pytest.approx(10.0)
    assert teacher[0]["value"]["height"] == pytest.approx(40.0)
    assert teacher[0]["value"]["rectanglelabels"] == ["7"] and teacher[0]["score"] == 0.9
    assert a["annotations"] == []
    human = tasks["b"]["annotations"][0]["result"]
    assert len(human) == 1 and human[0]["value"]["rectanglelabels"] == ["1"]


def test_json_records_carry_the_boxes_in_pixels() -> None:
    out = io.BytesIO()
    write_export("json", ROWS, out, blobs=Blobs(), image_url=str)  # type: ignore[arg-type]
    records = {r["sample_id"]: r for r in json.loads(out.getvalue())}
    assert records["a"]["boxes"][0]["bbox_xyxy"] == pytest.approx([32.0, 40.0, 96.0, 120.0])
    assert records["a"]["boxes"][0]["class_name"] == "7"
    assert records["c"]["boxes"] == [] and records["d"]["boxes"] is None
