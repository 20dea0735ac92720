from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from distill.cache import ReferenceModels
from distill.evaluate import OnnxClassifier, TorchClassifier
from distill.export import export_onnx, read_onnx_info
from distill.frames import FrameSet
from distill.models import StudentNet, load_checkpoint
from shared.errors import ModelError


@pytest.mark.parametrize("role", ["teacher", "student"])
def test_onnx_matches_torch(
    quick_models: ReferenceModels, small_test_set: FrameSet, role: str
) -> None:
    pt, path = (
        (quick_models.teacher_pt, quick_models.teacher_onnx)
        if role == "teacher"
        else (quick_models.student_pt, quick_models.student_onnx)
    )
    onnx_scores = OnnxClassifier(path).scores(small_test_set.frames)
    torch_scores = TorchClassifier.from_checkpoint(pt).scores(small_test_set.frames)
    assert np.abs(onnx_scores - torch_scores).max() < 1e-4
    np.testing.assert_allclose(onnx_scores.sum(1), 1.0, atol=1e-5)  # probabilities


def test_export_checks_optimized_against_unoptimized(quick_models: ReferenceModels) -> None:
    for role in ("teacher", "student"):
        report = quick_models.metrics[role]["export"]
        assert report["max_abs_diff_vs_unoptimized"] <= 1e-4
        assert report["max_abs_diff_vs_torch"] <= 1e-4
        assert "BatchNormalization" not in report["ops_final"]


def test_graph_contract(quick_models: ReferenceModels) -> None:
    model = onnx.load(str(quick_models.student_onnx))
    (inp,) = model.graph.input
    (out,) = model.graph.output
    assert inp.name == "frames" and out.name == "scores"
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == ["batch", 64, 64, 3]
    ops = {n.op_type for n in model.graph.node}
    assert {"Transpose", "Cast", "Softmax"} <= ops and "BatchNormalization" not in ops
    info = read_onnx_info(quick_models.student_onnx)
    assert info.labels == tuple(str(d) for d in range(10))
    assert info.precision == "fp32" and info.scores == "probabilities"
    assert info.name == "edgeloop-digits-student" and info.version.startswith("ref-")
    assert info.frame_size == 64 and info.opset == 17


def test_dynamic_batch(quick_models: ReferenceModels, small_test_set: FrameSet) -> None:
    clf = OnnxClassifier(quick_models.student_onnx, batch_size=7)
    whole = OnnxClassifier(quick_models.student_onnx).scores(small_test_set.frames[:20])
    np.testing.assert_allclose(clf.scores(small_test_set.frames[:20]), whole, atol=1e-6)
    assert clf.scores(small_test_set.frames[:1]).shape == (1, 10)


def test_export_of_fresh_model_other_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = StudentNet(4).eval()
    report = export_onnx(
        net, tmp_path / "m.onnx", class_names=list("abcd"), frame_size=32, name="x", version="1"
    )
    assert report.path.is_file() and report.max_abs_diff_vs_torch < 1e-4
    assert read_onnx_info(report.path).labels == ("a", "b", "c", "d")
    # No temporary files are left beside the output.
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_checkpoint_carries_metadata(quick_models: ReferenceModels) -> None:
    loaded = load_checkpoint(quick_models.student_pt)
    assert loaded.meta.arch == "student-cnn" and loaded.meta.frame_size == 64
    assert loaded.meta.train_config["role"] == "student"


def test_read_info_refuses_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "x.onnx").write_bytes(b"garbage")
    with pytest.raises(ModelError):
        read_onnx_info(tmp_path / "x.onnx")
    with pytest.raises(ModelError, match="no ONNX model"):
        read_onnx_info(tmp_path / "missing.onnx")
