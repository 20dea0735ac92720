from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from distill.cache import ReferenceModels
from distill.datasets import write_image_folder
from distill.drift import DRIFT_NAMES
from distill.frames import FrameSet
from simulations.cli_models import models_app

runner = CliRunner()


def _ok(args: list[str]) -> str:
    result = runner.invoke(models_app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _fails(args: list[str]) -> str:
    result = runner.invoke(models_app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory, small_test_set: FrameSet) -> Path:
    root = tmp_path_factory.mktemp("images") / "digits"
    write_image_folder(small_test_set.subset(slice(0, 80)), root)
    (root / "3" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    return root


def test_bootstrap_json_uses_cache(
    quick_models: ReferenceModels,
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path))
    out = json.loads(_ok(["bootstrap", "--quick", "--json", "--cache-dir", str(model_cache)]))
    assert out["built"] == [] and out["student_int8_onnx"] == str(quick_models.student_int8_onnx)
    assert out["student"]["test_accuracy"] == quick_models.metrics["student"]["test_accuracy"]
    # Installed where cloud-service and edge-agent load them: the teacher, the INT8 student.
    assert out["installed"] == {
        "teacher": str(tmp_path / "models" / "teacher.onnx"),
        "student": str(tmp_path / "models" / "student.onnx"),
        "student_weights": str(tmp_path / "models" / "student.pt"),
    }
    installed = (tmp_path / "models" / "student.onnx").read_bytes()
    assert installed == quick_models.student_int8_onnx.read_bytes()


def test_bootstrap_table(
    quick_models: ReferenceModels,
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path))
    out = _ok(["bootstrap", "--quick", "--cache-dir", str(model_cache)])
    assert "teacher FP32" in out and "student INT8" in out and "nothing (all cached)" in out
    assert f"installed the teacher: {tmp_path / 'models' / 'teacher.onnx'}" in out


def test_eval_reference_alias_with_drift(quick_models: ReferenceModels, model_cache: Path) -> None:
    common = ["--quick", "--cache-dir", str(model_cache), "--split", "validation", "--json"]
    clean = json.loads(_ok(["eval", "student", *common]))
    drifted = json.loads(_ok(["eval", "student", "--drift", "noise:1.0,blur:1", *common]))
    assert clean["accuracy"] > 0.5 and clean["drift"] == "none" and clean["split"] == "validation"
    assert drifted["drift"] == "blur:1,noise:1" and drifted["accuracy"] < clean["accuracy"]


def test_eval_model_file_table(quick_models: ReferenceModels) -> None:
    out = _ok(["eval", str(quick_models.student_int8_onnx), "--split", "validation"])
    assert "top-1" in out and "edgeloop-digits-student (int8)" in out


def test_eval_errors_are_one_line(quick_models: ReferenceModels, tmp_path: Path) -> None:
    out = _fails(["eval", str(tmp_path / "nope.onnx")])
    assert out.startswith("error: no model at") and out.count("\n") == 1
    out = _fails(["eval", str(quick_models.student_onnx), "--drift", "fog:1"])
    assert "unknown drift 'fog'" in out
    out = _fails(["eval", str(quick_models.student_onnx), "--data", str(tmp_path)])
    assert "no class subfolders" in out and "ROOT/<class name>/<image files>" in out


@pytest.mark.slow
def test_train_on_folder_then_eval_and_quantize(image_folder: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "out" / "mine.pt"
    report = json.loads(
        _ok(
            [
                "train",
                "--data",
                str(image_folder),
                "--role",
                "student",
                "--epochs",
                "2",
                "--out",
                str(ckpt),
                "--json",
            ]
        )
    )
    assert ckpt.is_file() and ckpt.with_suffix(".onnx").is_file()
    assert report["skipped_files"] >= 0 and report["classes"] == [str(d) for d in range(10)]
    assert report["train_frames"] + report["validation_frames"] <= 80
    ev = json.loads(
        _ok(["eval", str(ckpt.with_suffix(".onnx")), "--data", str(image_folder), "--json"])
    )
    assert ev["split"] == "all" and ev["frames"] == 80 and ev["skipped_files"] == 1
    q = json.loads(
        _ok(
            [
                "quantize",
                str(ckpt.with_suffix(".onnx")),
                "--calibration",
                str(image_folder),
                "--json",
            ]
        )
    )
    assert Path(q["path"]).name == "mine.int8.onnx" and q["size_ratio"] <= 0.3
    assert q["folded_input"] is True and q["evaluated_on"].startswith(
        f"test split of {image_folder}"
    )
    assert "held out; calibrated on its train split" in q["evaluated_on"]


def test_train_refuses_bad_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = _fails(["train", "--data", str(tmp_path / "empty"), "--role", "teacher"])
    assert "no class subfolders" in out


def test_quantize_reference_student_on_digits(
    quick_models: ReferenceModels, model_cache: Path, tmp_path: Path
) -> None:
    target = tmp_path / "s8.onnx"
    q = json.loads(
        _ok(
            [
                "quantize",
                "student",
                "--quick",
                "--cache-dir",
                str(model_cache),
                "--settings",
                "s8s8",
                "--out",
                str(target),
                "--json",
            ]
        )
    )
    assert target.is_file() and q["settings"] == "S8S8" and q["folded_input"] is False
    assert q["evaluated_on"].startswith("test split of digits")
    assert abs(q["accuracy_delta_points"]) < 5
    assert "bad quantization setting" in _fails(["quantize", str(target), "--settings", "fp4"])


def test_drifts_lists_every_kind() -> None:
    out = _ok(["drifts"])
    for name in DRIFT_NAMES:
        assert name in out


def test_quantize_never_writes_into_the_cache(
    quick_models: ReferenceModels,
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    before = quick_models.student_int8_onnx.stat().st_mtime_ns
    q = json.loads(
        _ok(["quantize", "student", "--quick", "--cache-dir", str(model_cache), "--json"])
    )
    assert (
        Path(q["path"]) == Path("student.int8.onnx") and (tmp_path / "student.int8.onnx").is_file()
    )
    assert q["settings"] == "U8S8+reduce_range"
    assert quick_models.student_int8_onnx.stat().st_mtime_ns == before
