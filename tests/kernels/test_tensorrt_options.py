"""TensorRT profile derivation, build-engine's clear failure, and the I/O binding choice (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from kernels.tensorrt import profile_shapes, tensorrt_provider_options


def _model(tmp_path: Path, dims: list[int | str], name: str = "frames") -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info(name, TensorProto.UINT8, dims)
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, dims)
    graph = helper.make_graph([helper.make_node("Identity", [name], ["y"])], "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_profiles_span_the_batch_sizes(tmp_path: Path) -> None:
    model = _model(tmp_path, ["batch", 64, 64, 3])
    (p,) = profile_shapes(model, [8, 1, 32])
    assert (p.name, p.min, p.opt, p.max) == (
        "frames",
        (1, 64, 64, 3),
        (32, 64, 64, 3),
        (32, 64, 64, 3),
    )


def test_provider_options_in_ort_syntax(tmp_path: Path) -> None:
    model = _model(tmp_path, ["N", 96, 96, 3])
    opts = tensorrt_provider_options(model, [1, 8], cache_dir=tmp_path / "cache", int8=True)
    assert opts["trt_profile_min_shapes"] == "frames:1x96x96x3"
    assert opts["trt_profile_opt_shapes"] == "frames:8x96x96x3"
    assert opts["trt_profile_max_shapes"] == "frames:8x96x96x3"
    assert opts["trt_int8_enable"] is True and opts["trt_fp16_enable"] is True
    assert opts["trt_engine_cache_enable"] is True
    assert Path(opts["trt_engine_cache_path"]).is_dir()


def test_dynamic_spatial_axes_need_a_size(tmp_path: Path) -> None:
    model = _model(tmp_path, ["N", "H", "W", 3])
    with pytest.raises(ValueError, match="default_hw"):
        profile_shapes(model, [1, 4])
    (p,) = profile_shapes(model, [1, 4], default_hw=(120, 160))
    assert p.max == (4, 120, 160, 3)


def test_fixed_batch_axis_is_kept(tmp_path: Path) -> None:
    (p,) = profile_shapes(_model(tmp_path, [1, 3, 32, 32]), [1, 32])
    assert p.min == p.max == (1, 3, 32, 32)


def test_bad_batch_sizes_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        profile_shapes(_model(tmp_path, ["N", 8, 8, 3]), [0])


def test_build_engine_fails_clearly_without_tensorrt(tmp_path: Path) -> None:
    pytest.importorskip("typer")
    try:
        import tensorrt  # type: ignore[import-not-found]  # noqa: F401

        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    from simulations.cli_engine import register_engine_command

    app = typer.Typer()
    app.command("noop")(lambda: None)
    register_engine_command(app)
    model = _model(tmp_path, ["N", 8, 8, 3])
    result = CliRunner().invoke(
        app, ["build-engine", str(model), "--out", str(tmp_path / "m.plan"), "--batch", "1,8"]
    )
    assert result.exit_code == 2
    assert "tensorrt Python package is not installed" in result.output


def test_cpu_teacher_takes_the_plain_path(tmp_path: Path) -> None:
    from cloud_service.demo_teacher import build_demo_teacher
    from cloud_service.verifier import TeacherModel, uses_io_binding

    assert uses_io_binding("CUDAExecutionProvider")
    assert not uses_io_binding("CPUExecutionProvider")
    teacher = TeacherModel(build_demo_teacher(tmp_path / "t.onnx", size=16, hidden=8, seed=0))
    assert teacher.info.provider == "CPUExecutionProvider"
    assert teacher._binding is None
    scores = teacher.predict(np.zeros((2, 16, 16, 3), np.uint8))
    assert scores.shape[0] == 2
