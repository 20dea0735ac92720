"""A user's float32 NCHW 224x224 classifier, normalised outside its graph, imported with
``edgeloop models import`` and served by the real agent engine and the verifier's teacher
path on uint8 frames, gives what onnxruntime gives on the original model with the same
preprocessing done in NumPy (atol 1e-4)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from cloud_service.batcher import BatcherConfig, DynamicBatcher
from cloud_service.verifier import TeacherModel
from edge_agent.agent import Agent
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher
from simulations.cli import app

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
LABELS = ["cat", "dog", "bird", "fish", "horse"]
ATOL = 1e-4


class _Classifier(nn.Module):
    """A small convnet on normalised NCHW input, returning logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 5, stride=4, padding=2),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, len(LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def _export_user_model(path: Path) -> None:
    """Export as a user would: batch fixed at 1, input 'input', output 'logits'."""
    torch.manual_seed(7)
    net = _Classifier().eval()
    # Weights large enough that the classes differ clearly on random frames.
    with torch.no_grad():
        net.head.weight.mul_(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net,
            (torch.zeros(1, 3, 224, 224),),
            str(path),
            dynamo=False,
            input_names=["input"],
            output_names=["logits"],
            opset_version=17,
        )


def _reference(path: Path, frames: np.ndarray) -> np.ndarray:
    """onnxruntime on the original model, one frame at a time, preprocessing in NumPy."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = (frames.astype(np.float32) / 255.0 - MEAN) / STD  # [N, H, W, 3]
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))  # [N, 3, H, W]
    logits = np.concatenate(
        [session.run(["logits"], {"input": x[i : i + 1]})[0] for i in range(len(x))]
    )
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=1, keepdims=True), np.float32)


def _import(tmp_path: Path, source: Path, role: str) -> tuple[Path, dict[str, object]]:
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(LABELS) + "\n")
    out = tmp_path / f"{role}.onnx"
    result = CliRunner().invoke(
        app,
        [
            "models", "import", str(source),
            "--role", role,
            "--labels", str(labels),
            "--input", "input",
            "--layout", "NCHW",
            "--dtype", "float32",
            "--size", "224x224",
            "--mean", "0.485,0.456,0.406",
            "--std", "0.229,0.224,0.225",
            "--scale", repr(1 / 255),
            "--outputs", "logits",
            "--out", str(out),
            "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    """Noise, black, white and three solid colours: inputs the classifier tells apart."""
    rng = np.random.default_rng(11)
    batch = rng.integers(0, 256, size=(6, 224, 224, 3), dtype=np.uint8)
    for index, colour in enumerate([(0, 0, 0), (255, 255, 255), (255, 0, 0), (0, 0, 255)], 1):
        batch[index] = colour
    return batch


def test_imported_model_served_by_agent_and_verifier_matches_the_original(
    tmp_path: Path, frames: np.ndarray
) -> None:
    source = tmp_path / "user-classifier.onnx"
    _export_user_model(source)
    expected = _reference(source, frames)

    student_path, student_report = _import(tmp_path, source, "student")
    teacher_path, _ = _import(tmp_path, source, "teacher")
    card = json.loads((tmp_path / "student.card.json").read_text())
    assert card["input"] == {
        "name": "frames",
        "shape": ["batch", 224, 224, 3],
        "dtype": "uint8",
        "layout": "NHWC",
        "color": "RGB",
        "mean": [0.0, 0.0, 0.0],
        "std": [1.0, 1.0, 1.0],
        "scale": 1.0,
    }
    assert card["source"]["input"]["layout"] == "NCHW"
    assert card["source"]["input"]["mean"] == pytest.approx(MEAN.tolist())
    assert card["labels"] == LABELS

    # The agent's engine: the real OrtEngine, on the student contract.
    engine = OrtEngine(
        student_path, EngineOptions(providers=("CPUExecutionProvider",), warmup_runs=1)
    )
    assert engine.input_hw == (224, 224)
    assert engine.labels == LABELS
    assert engine.version == student_report["version"]
    agent_scores = engine.run(frames)
    # And the whole agent answering each frame (batcher, routing, the sample's tags).
    settings = AgentSettings(
        data_dir=tmp_path / "agent",
        model_path=student_path,
        agent_id="cam-1",
        intra_op_threads=1,
        warmup_runs=1,
        heartbeat_s=3600.0,
    )
    with Agent(settings, engine=engine, publisher=MemoryPublisher(), start_sources=False) as agent:
        answers = [agent.process(frame, source="test") for frame in frames]
    answered = np.asarray([a.scores for a in answers], np.float32)
    assert {(a.model_name, a.model_version) for a in answers} == {
        (student_report["name"], student_report["version"])
    }

    # The verifier's teacher path: the TeacherModel session behind the dynamic batcher.
    teacher = TeacherModel(teacher_path, providers=["CPUExecutionProvider"])
    assert teacher.input_size == (224, 224)
    assert teacher.info.labels == tuple(LABELS)
    with DynamicBatcher(teacher.score_many, BatcherConfig(max_batch_size=4)) as batcher:
        futures = [batcher.submit(frame, shape=frame.shape) for frame in frames]
        verifier_scores = np.stack([f.result(timeout=60).scores for f in futures])

    agent_diff = float(np.abs(agent_scores - expected).max())
    verifier_diff = float(np.abs(verifier_scores - expected).max())
    answered_diff = float(np.abs(answered - expected).max())
    print(
        f"\nimported-model parity: agent engine max|diff| {agent_diff:.3e},"
        f" agent answers {answered_diff:.3e},"
        f" verifier max|diff| {verifier_diff:.3e},"
        f" import's own check {student_report['max_abs_diff']:.3e} (atol {ATOL:g})"
    )
    assert agent_scores.shape == expected.shape == (len(frames), len(LABELS))
    assert agent_diff <= ATOL
    assert verifier_diff <= ATOL
    assert answered_diff <= ATOL
    assert float(np.ptp(expected, axis=0).max()) > 0.05  # the frames' scores really differ
