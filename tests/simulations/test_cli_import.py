"""``edgeloop models import``: one-line results and refusals, ``--install``, default scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shared.manifest import ModelCard
from simulations.cli import app
from tests.distill.test_model_import import (
    MEAN,
    STD,
    _classifier,
    _frames,
    _original,
    _run,
    _softmax,
)


def test_cli_imports_and_refuses_in_one_line(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "user.onnx")
    labels = tmp_path / "labels.txt"
    labels.write_text("red\ngreen\nblue\n")
    args = ["models", "import", str(source), "--role", "student", "--labels", str(labels)]
    args += ["--input", "input", "--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"]
    ok = CliRunner().invoke(app, [*args, "--scale", "0.00392156862745098"])
    assert ok.exit_code == 0, ok.output
    assert "frames uint8 [batch, 8, 8, 3] -> scores [batch, 3]" in ok.output
    assert (tmp_path / "user-edgeloop.onnx").is_file()
    assert (tmp_path / "user-edgeloop.card.json").is_file()
    bad = CliRunner().invoke(app, [*args[:-4], "--mean", "1,2"])
    assert bad.exit_code == 2
    assert bad.output.strip() == "error: --mean takes three numbers R,G,B, got 2"
    wrong = CliRunner().invoke(app, [*args, "--size", "224x224"])
    assert wrong.exit_code == 2 and "fixed height of 8; --size asks 224" in wrong.output


def test_cli_install_puts_model_and_card_where_the_role_loads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(data_dir))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    source = _classifier(tmp_path / "user.onnx")
    labels = tmp_path / "labels.txt"
    labels.write_text("red\ngreen\nblue\n")
    for role in ("teacher", "student"):
        done = CliRunner().invoke(
            app,
            ["models", "import", str(source), "--role", role, "--labels", str(labels),
             "--input", "input", "--scale", "0.00392156862745098", "--install", "--json",
             "--out", str(tmp_path / f"{role}-wrapped.onnx")],
        )  # fmt: skip
        assert done.exit_code == 0, done.output
        installed = data_dir / "models" / f"{role}.onnx"
        assert json.loads(done.stdout)["installed"] == str(installed)
        assert installed.read_bytes() == (tmp_path / f"{role}-wrapped.onnx").read_bytes()
        card = ModelCard.model_validate_json(
            (data_dir / "models" / f"{role}.card.json").read_text()
        )
        assert card.role == role


def test_cli_scale_defaults_to_pixels_in_0_1_for_float32(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "user.onnx")
    labels = tmp_path / "labels.txt"
    labels.write_text("red\ngreen\nblue\n")
    done = CliRunner().invoke(
        app,
        ["models", "import", str(source), "--role", "teacher", "--labels", str(labels),
         "--input", "input", "--layout", "NCHW", "--dtype", "float32", "--size", "8x8",
         "--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225",
         "--out", str(tmp_path / "w.onnx")],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    card = ModelCard.model_validate_json((tmp_path / "w.card.json").read_text())
    assert card.source.input.scale == pytest.approx(1 / 255)
    frames = _frames()
    x = ((frames / 255.0 - np.array(MEAN)) / np.array(STD)).astype(np.float32)
    want = _softmax(_original(source, np.ascontiguousarray(x.transpose(0, 3, 1, 2))))
    assert np.abs(_run(tmp_path / "w.onnx", frames) - want).max() <= 1e-4
