"""``edgeloop models train --task detection`` on a user's COCO folder: a student whose
files a fleet serves (FP32, INT8) and a distillation job warm-starts from (.pt)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from cloud_service.registry import build_manifest
from distill.detection_formats import write_coco, write_yolo
from distill.detector_cache import reference_scenario
from distill.detectors import load_detector
from distill.scenes import DetectionSet, render_scenes
from simulations.cli_models import models_app

runner = CliRunner()


def _scenes(count: int) -> DetectionSet:
    frames = render_scenes("validation", reference_scenario(160))
    return frames.subset(np.arange(count))


def test_train_a_detection_student_on_a_coco_folder(tmp_path: Path) -> None:
    write_coco(_scenes(30), tmp_path / "belt")
    out = tmp_path / "models" / "belt-student.pt"
    args = ["train", "--task", "detection", "--data", str(tmp_path / "belt")]
    args += ["--role", "student", "--frame-size", "160", "--epochs", "1", "--out", str(out)]
    result = runner.invoke(models_app, [*args, "--json"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["task"] == "detection" and report["classes"] == [str(d) for d in range(10)]
    assert report["train_frames"] + report["validation_frames"] + report["test_frames"] == 30
    assert 0.0 <= report["test_map50"] <= 1.0 and 0.0 <= report["int8_test_map50"] <= 1.0
    assert load_detector(out).meta.frame_size == 160
    for path in (out.with_suffix(".onnx"), out.with_name("belt-student.int8.onnx")):
        manifest = build_manifest(path.read_bytes(), version="1")
        assert manifest.task == "detection" and manifest.input.shape[1:] == [160, 160, 3]


def test_a_yolo_folder_with_unreadable_labels_is_one_line_and_status_2(tmp_path: Path) -> None:
    write_yolo(_scenes(4), tmp_path / "yolo")
    label = next(p for p in (tmp_path / "yolo").rglob("*.txt") if p.name != "classes.txt")
    label.write_text("not a box\n")
    args = ["train", "--task", "detection", "--data", str(tmp_path / "yolo"), "--role", "student"]
    result = runner.invoke(models_app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "not 'class cx cy w h'" in result.output
