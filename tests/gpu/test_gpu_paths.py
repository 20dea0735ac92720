"""On a GPU: kernels compiled for real, ORT's CUDA and TensorRT providers, I/O binding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_kernels_compiled_match_reference() -> None:
    from kernels import preprocess as pre
    from kernels import scoring

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 240, 320, 3), dtype=np.uint8)
    got = pre.preprocess(torch.from_numpy(frames).cuda(), (224, 224))
    np.testing.assert_allclose(
        got.cpu().numpy(), pre.preprocess_reference(frames, (224, 224)), atol=1e-4
    )
    logits = rng.normal(size=(64, 1000)).astype(np.float32)
    s = scoring.score(torch.from_numpy(logits).cuda())
    np.testing.assert_allclose(
        s.entropy.cpu().numpy(), scoring.score_reference(logits).entropy, atol=1e-4
    )


def _teacher(tmp_path: Path) -> Path:
    from cloud_service.demo_teacher import build_demo_teacher

    return build_demo_teacher(tmp_path / "t.onnx", size=64, hidden=256, seed=0)


def test_cuda_teacher_uses_io_binding(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu without CUDAExecutionProvider")
    from cloud_service.verifier import TeacherModel

    model = _teacher(tmp_path)
    gpu = TeacherModel(model, providers=["CUDAExecutionProvider"])
    cpu = TeacherModel(model, providers=["CPUExecutionProvider"])
    assert gpu.info.provider == "CUDAExecutionProvider" and gpu._binding is not None
    frames = np.random.default_rng(1).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    for _ in range(2):  # second run reuses the pre-allocated buffers
        np.testing.assert_allclose(gpu.predict(frames), cpu.predict(frames), atol=1e-3)


def test_tensorrt_teacher_with_derived_profiles(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu without TensorrtExecutionProvider")
    from cloud_service.verifier import TeacherModel

    teacher = TeacherModel(
        _teacher(tmp_path),
        providers=["TensorrtExecutionProvider", "CUDAExecutionProvider"],
        batch_sizes=(1, 32),
        trt_cache_dir=tmp_path / "trt",
    )
    assert teacher.info.provider == "TensorrtExecutionProvider"
    scores = teacher.predict(np.zeros((32, 64, 64, 3), np.uint8))
    assert scores.shape[0] == 32


def test_cuda_teacher_runs_the_kernel_path(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu without CUDAExecutionProvider")
    from cloud_service.verifier import TeacherModel

    model = _teacher(tmp_path)
    gpu = TeacherModel(model, providers=["CUDAExecutionProvider"])
    graph = TeacherModel(model, providers=["CUDAExecutionProvider"], gpu_kernels=False)
    cpu = TeacherModel(model, providers=["CPUExecutionProvider"])
    assert gpu.preprocessing == "kernels" and graph.preprocessing == "graph"
    frames = np.random.default_rng(2).integers(0, 256, (32, 64, 64, 3), dtype=np.uint8)
    want = cpu.score(frames)
    for _ in range(2):
        got = gpu.score(frames)
        assert gpu.preprocessing == "kernels"  # no fallback happened
        np.testing.assert_allclose(got.probs, want.probs, atol=1e-3)
        np.testing.assert_allclose(got.entropy, want.entropy, atol=1e-3)
    np.testing.assert_allclose(graph.predict(frames), want.probs, atol=1e-3)
