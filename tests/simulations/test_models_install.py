"""``edgeloop models install FILE --role``: checked in ONNX Runtime, put where the
serving process loads it, replaced in one step."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from simulations.cli_models import models_app

runner = CliRunner()


def _identity_model(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["frames"], ["scores"])],
        "tiny",
        [helper.make_tensor_value_info("frames", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def test_install_puts_each_role_where_its_process_looks(data_dir: Path, tmp_path: Path) -> None:
    model = _identity_model(tmp_path / "mine.onnx")
    stale = data_dir / "models" / "student.pt"  # weights of the model being replaced
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old weights")
    for role in ("teacher", "student"):
        result = runner.invoke(models_app, ["install", str(model), "--role", role, "--json"])
        assert result.exit_code == 0, result.output
        target = data_dir / "models" / f"{role}.onnx"
        assert json.loads(result.stdout)["installed"] == str(target)
        assert target.read_bytes() == model.read_bytes()
    assert sorted(p.name for p in (data_dir / "models").iterdir()) == [
        "student.onnx",
        "teacher.onnx",
    ]  # no temporary file left beside them


def test_install_follows_the_configured_path(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGELOOP_TEACHER_MODEL", str(tmp_path / "elsewhere" / "t.onnx"))
    model = _identity_model(tmp_path / "mine.onnx")
    result = runner.invoke(models_app, ["install", str(model), "--role", "teacher"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "t.onnx").is_file()


def test_install_refuses_what_onnx_runtime_cannot_load(data_dir: Path, tmp_path: Path) -> None:
    target = data_dir / "models" / "student.onnx"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"the serving model")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    result = runner.invoke(models_app, ["install", str(bad), "--role", "student"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "does not load in ONNX Runtime" in " ".join(result.output.split())
    assert target.read_bytes() == b"the serving model"  # the old one still serves
    missing = runner.invoke(models_app, ["install", str(tmp_path / "no.onnx"), "--role", "student"])
    assert missing.exit_code == 2 and "no model file" in missing.output
