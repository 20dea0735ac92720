"""The ORT engine on the student contract: shapes, labels, providers, degradation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_agent.engine import EngineOptions, OrtEngine, choose_providers
from edge_agent.testing import make_tiny_student
from shared.errors import ModelError


def test_scores_are_probabilities(engine: OrtEngine) -> None:
    frames = np.random.default_rng(0).integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)
    scores = engine.run(frames)
    assert scores.shape == (5, 4)
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)


def test_contract_metadata(engine: OrtEngine) -> None:
    assert engine.input_hw == (32, 32)
    assert engine.labels == ["class-0", "class-1", "class-2", "class-3"]
    assert engine.name == "tiny-student"
    assert engine.version == "test-1"
    assert engine.provider == "cpu"


def test_defaults_without_metadata(tmp_path: Path) -> None:
    path = make_tiny_student(tmp_path / "plain.onnx", classes=3)
    model = onnx.load(str(path))
    del model.metadata_props[:]
    onnx.save(model, str(path))
    engine = OrtEngine(path, EngineOptions(warmup_runs=0))
    assert engine.labels == ["0", "1", "2"]
    assert engine.name == "plain"
    assert len(engine.version) == 12  # sha256 prefix


def test_provider_preference() -> None:
    available = ["CUDAExecutionProvider", "CPUExecutionProvider", "TensorrtExecutionProvider"]
    assert choose_providers(available) == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers(available, ("CUDAExecutionProvider",)) == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]


def test_missing_and_foreign_models(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        OrtEngine(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="cannot load"):
        OrtEngine(bad)


def test_runtime_degradation_to_cpu(engine: OrtEngine, student_path: Path) -> None:
    """A failing GPU session is replaced by a CPU one and the batch still answers."""
    degrading = OrtEngine(student_path, EngineOptions(warmup_runs=0))

    class FailingSession:
        def run(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("CUDA failure 700: illegal address")

        def get_providers(self) -> list[str]:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    degrading._session = FailingSession()
    frames = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    scores = degrading.run(frames)
    assert scores.shape == (2, 4)
    assert degrading.degraded
    assert degrading.provider == "cpu"


def test_the_models_task_is_read_and_an_unknown_task_is_refused(tmp_path: Path) -> None:
    path = make_tiny_student(tmp_path / "student.onnx")
    assert OrtEngine(path, EngineOptions(warmup_runs=0)).task == "classification"
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key, entry.value = "edgeloop.task", "segmentation"
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match="unknown task 'segmentation'"):
        OrtEngine(path, EngineOptions(warmup_runs=0))
