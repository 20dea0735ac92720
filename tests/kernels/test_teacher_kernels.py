"""The verifier's kernel path: the teacher split, the path selection and the path itself.

The path runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), with
ONNX Runtime's CPU provider bound to the same buffers; with the kernels compiled
(``make gpu-check``) it runs on CUDA.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.verifier import TeacherModel, scores_from_probs, use_gpu_kernels
from kernels import preprocess as pre
from kernels import scoring
from kernels.graph import split_teacher

torch = pytest.importorskip("torch")
if not pre.HAVE_TRITON:
    pytest.skip("triton is not installed (pip install the dev extra)", allow_module_level=True)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRET
    and not (
        torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()
    ),
    reason="TRITON_INTERPRET=0 and no CUDA device for ONNX Runtime",
)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_teacher(
        tmp_path_factory.mktemp("teacher") / "t.onnx", size=16, hidden=32, seed=0
    )


def _frames(n: int = 3, size: int = 16) -> np.ndarray:
    return np.random.default_rng(4).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def test_split_teacher_moves_preprocessing_and_softmax_out(teacher_path: Path) -> None:
    split = split_teacher(teacher_path)
    assert split is not None and split.logits
    # The demo teacher scales by 1/255: mean 0, std 1 in the kernel's terms.
    np.testing.assert_allclose(split.mean, (0, 0, 0), atol=1e-7)
    np.testing.assert_allclose(split.std, (1, 1, 1), rtol=1e-6)
    frames = _frames()
    full = ort.InferenceSession(str(teacher_path), providers=["CPUExecutionProvider"])
    variant = ort.InferenceSession(split.model, providers=["CPUExecutionProvider"])
    pixels = pre.preprocess_reference(frames, (16, 16), mean=split.mean, std=split.std)
    (logits,) = variant.run(None, {split.input_name: pixels})
    (probs,) = full.run(None, {"frames": frames})
    np.testing.assert_allclose(_softmax(logits), probs, atol=1e-6)


def test_split_teacher_reads_mean_and_std_after_the_transpose(tmp_path: Path) -> None:
    # distill's export order: Transpose (uint8), Cast, Sub, Mul, then the network.
    nodes = [
        helper.make_node("Transpose", ["frames"], ["t"], perm=[0, 3, 1, 2]),
        helper.make_node("Cast", ["t"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["f", "zero"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["x"]),
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Softmax", ["m"], ["scores"], axis=1),
    ]
    inits = [
        numpy_helper.from_array(np.array([[[128.0]], [[100.0]], [[90.0]]], np.float32), "zero"),
        numpy_helper.from_array(np.array(1 / 64, np.float32), "scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["n", 8, 8, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    split = split_teacher(tmp_path / "m.onnx")
    assert split is not None and split.logits and split.input_name == "x"
    np.testing.assert_allclose(split.mean, (128 / 255, 100 / 255, 90 / 255), rtol=1e-5)
    np.testing.assert_allclose(split.std, (64 / 255,) * 3, rtol=1e-5)


def test_split_teacher_declines_a_graph_without_the_nchw_transpose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nodes = [
        helper.make_node("Cast", ["frames"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["f"], ["m"], axes=[1, 2], keepdims=0),
        helper.make_node("Softmax", ["m"], ["scores"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["n", 8, 8, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    with caplog.at_level(logging.INFO, logger="kernels.graph"):
        assert split_teacher(tmp_path / "m.onnx") is None
    assert "transpose" in caplog.text


@pytest.mark.parametrize(
    ("provider", "wanted", "cuda", "triton", "expected"),
    [
        ("CUDAExecutionProvider", True, True, True, True),
        ("CUDAExecutionProvider", False, True, True, False),
        ("CUDAExecutionProvider", True, False, True, False),
        ("CUDAExecutionProvider", True, True, False, False),
        ("TensorrtExecutionProvider", True, True, True, False),
        ("CPUExecutionProvider", True, True, True, False),
    ],
)
def test_kernel_path_only_on_cuda_with_triton(
    provider: str, wanted: bool, cuda: bool, triton: bool, expected: bool
) -> None:
    assert use_gpu_kernels(provider, wanted=wanted, cuda=cuda, triton=triton) is expected


def test_cpu_teacher_keeps_the_graph_path(teacher_path: Path) -> None:
    teacher = TeacherModel(teacher_path, providers=["CPUExecutionProvider"])
    assert teacher.preprocessing == "graph"
    frames = _frames()
    probs = teacher.predict(frames)
    result = teacher.score(frames)
    np.testing.assert_array_equal(result.probs, probs)
    np.testing.assert_array_equal(result.label, probs.argmax(axis=1))
    per_frame = teacher.score_many(list(frames))
    assert [r.label for r in per_frame] == probs.argmax(axis=1).tolist()


@needs_kernels
def test_kernel_path_matches_the_graph_path(teacher_path: Path) -> None:
    teacher = TeacherModel(teacher_path, providers=["CPUExecutionProvider"])
    path = teacher._kernel_path(ort.SessionOptions(), device=DEVICE)
    assert path is not None
    frames = _frames()
    got = path.run(frames)
    want = teacher.score(frames)
    atol = 1e-6 if INTERPRET else 1e-3  # TF32 and fused kernels on a GPU
    np.testing.assert_allclose(got.probs, want.probs, atol=atol)
    np.testing.assert_array_equal(got.label, want.label)
    for field in ("confidence", "margin", "entropy"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), atol=10 * atol)


def test_a_failing_kernel_path_falls_back_to_the_graph(teacher_path: Path) -> None:
    teacher = TeacherModel(teacher_path, providers=["CPUExecutionProvider"])
    frames = _frames()
    want = teacher.predict(frames)

    class Broken:
        def run(self, frames: np.ndarray) -> None:
            raise RuntimeError("no kernel image for this GPU")

    teacher._kernels = Broken()  # type: ignore[assignment]
    assert teacher.preprocessing == "kernels"
    np.testing.assert_array_equal(teacher.predict(frames), want)
    assert teacher.preprocessing == "graph"


def test_scores_from_probs_agrees_with_the_scoring_reference() -> None:
    logits = np.random.default_rng(5).normal(size=(6, 7)).astype(np.float32) * 3
    reference = scoring.score_reference(logits)
    ours = scores_from_probs(reference.probs)
    np.testing.assert_array_equal(ours.label, reference.top1)
    np.testing.assert_allclose(ours.confidence, reference.confidence, atol=1e-6)
    np.testing.assert_allclose(ours.margin, reference.margin, atol=1e-6)
    np.testing.assert_allclose(ours.entropy, reference.entropy, atol=1e-5)
    one_hot = scores_from_probs(np.array([[1.0, 0.0, 0.0]], np.float32))
    assert one_hot.entropy[0] == 0.0 and one_hot.margin[0] == 1.0
