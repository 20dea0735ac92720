"""An agent serving a detector: boxes in its answers, detection routing, boxes uplinked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_agent.agent import Agent
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.settings import AgentSettings
from edge_agent.testing import make_tiny_detector
from shared.envelope import decode_envelope
from shared.errors import ModelError
from shared.tasks import DETECTION

BOXES = [(0.1, 0.1, 0.4, 0.5, 1), (0.5, 0.2, 0.9, 0.7, 2)]


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> OrtEngine:
    path = make_tiny_detector(tmp_path_factory.mktemp("det") / "detector.onnx", boxes=BOXES)
    return OrtEngine(path, EngineOptions(intra_op_threads=1, warmup_runs=1))


def gray(level: int) -> np.ndarray:
    """A frame the tiny detector scores ``level / 255`` on every box."""
    return np.full((32, 32, 3), level, np.uint8)


def test_the_engine_reads_a_detector_and_its_rows(detector: OrtEngine) -> None:
    assert detector.task == "detection" and detector.labels == ["class-0", "class-1", "class-2"]
    rows = detector.run(np.stack([gray(204), gray(51)]))
    assert rows.shape == (2, 8, 6)
    sure, faint = DETECTION.answers(rows)
    assert [b[5] for b in sure.boxes] == [1, 2] and sure.confidence == pytest.approx(0.8)
    assert faint.boxes == ()  # 0.2 is under the 0.3 score threshold: an empty frame


def test_a_detector_without_labels_is_refused(tmp_path: Path) -> None:
    path = make_tiny_detector(tmp_path / "d.onnx")
    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key != "edgeloop.labels"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match=r"must name its edgeloop\.labels"):
        OrtEngine(path, EngineOptions(warmup_runs=0))


def test_the_agent_answers_with_boxes_and_forwards_by_the_detection_rules(
    make_settings: Callable[..., AgentSettings],
    detector: OrtEngine,
    until: Callable[..., bool],
) -> None:
    from edge_agent.testing import MemoryPublisher

    publisher = MemoryPublisher(auto_receipt=True)
    settings = make_settings(route_mean_score_below=0.5, empty_audit_share=1.0)
    with Agent(settings, engine=detector, publisher=publisher) as agent:  # type: ignore[arg-type]
        sure = agent.submit(gray(204), source="test").result(10)
        unsure = agent.submit(gray(102), source="test").result(10)
        empty = agent.submit(gray(0), source="test").result(10)
        assert until(lambda: len(publisher.sent()) == 2)
    assert not sure.forwarded and sure.label == "class-1"
    assert sure.boxes is not None and [b[5] for b in sure.boxes] == [1, 2]
    assert sure.as_dict()["boxes"] == sure.boxes
    assert unsure.forwarded and unsure.route_reason == "mean_score"
    assert empty.forwarded and empty.route_reason == "empty_audit" and empty.boxes == []
    headers = {h.sample_id: h for h in (decode_envelope(p).header for p in publisher.sent())}
    sent = headers[unsure.sample_id]
    assert sent.boxes is not None and len(sent.boxes) == 2
    assert sent.boxes[0][:4] == pytest.approx(list(BOXES[0][:4]))
    assert sent.confidence == pytest.approx(0.4, abs=1e-3)
    assert headers[empty.sample_id].boxes == [] and headers[empty.sample_id].scores == []
