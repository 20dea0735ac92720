"""A fleet of detectors takes model updates as a fleet of classifiers does: the
registry describes a detector (its ``detections`` output, its golden rows), and the
agent checks the golden rows before it swaps, and refuses a model of another task."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_service.registry import build_manifest
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher, make_tiny_detector, make_tiny_student
from shared.manifest import FleetSigningKey, ModelManifest
from shared.messages import encode_message, sign_manifest

KEY = FleetSigningKey.generate()
CLOUD = "http://127.0.0.1:8080"
ONE_BOX = [(0.1, 0.1, 0.4, 0.5, 1)]
MOVED_BOX = [(0.2, 0.2, 0.6, 0.7, 2)]


class Artifacts:
    """Serves artifacts by sha256 to the agent's token."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.requests = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if request.headers.get("authorization") != "Bearer agent-token":
            return httpx.Response(401)
        return httpx.Response(200, content=self.blobs[request.url.path.rsplit("/", 1)[-1]])


def announce(
    path: Path, artifacts: Artifacts, change: Callable[[ModelManifest], ModelManifest] | None = None
) -> bytes:
    data = path.read_bytes()
    manifest = build_manifest(data)
    manifest = manifest.model_copy(update={"url": f"{CLOUD}/artifacts/{manifest.sha256}"})
    if change is not None:
        manifest = change(manifest)
    artifacts.blobs[manifest.sha256] = data
    return encode_message(sign_manifest(manifest, KEY))


@pytest.fixture
def artifacts() -> Artifacts:
    return Artifacts()


@pytest.fixture
def agent(
    tmp_path: Path, make_settings: Callable[..., AgentSettings], artifacts: Artifacts
) -> Iterator[tuple[Agent, MemoryPublisher]]:
    serving = make_tiny_detector(tmp_path / "serving.onnx", boxes=ONE_BOX, version="det-1")
    settings = make_settings(
        model_path=serving,
        fleet_public_key=KEY.public_key_b64,
        cloud_url=CLOUD,
        api_token="agent-token",
        update_retry_s=60.0,
    )
    publisher = MemoryPublisher()
    transport = httpx.MockTransport(artifacts.handler)
    with Agent(settings, publisher=publisher, start_sources=False, model_transport=transport) as a:
        yield a, publisher


def deliver(agent: Agent, publisher: MemoryPublisher, raw: bytes, until: Any) -> dict[str, Any]:
    before = agent.updater.last_result
    publisher.deliver(agent.updater.topic_fleet, raw)
    assert until(lambda: agent.updater.last_result is not before, timeout=20)
    result = agent.updater.last_result
    assert result is not None
    return result


def bright() -> np.ndarray:
    return np.full((32, 32, 3), 230, np.uint8)


def test_the_registry_describes_a_detector_by_its_task(tmp_path: Path) -> None:
    path = make_tiny_detector(tmp_path / "d.onnx", boxes=ONE_BOX, rows=8)
    manifest = build_manifest(path.read_bytes())
    assert manifest.task == "detection" and manifest.output_name == "detections"
    assert manifest.labels == ["class-0", "class-1", "class-2"]
    (case,) = manifest.golden
    assert all(len(row) == 8 * 6 for row in case.expected)


def test_a_detector_update_is_checked_against_its_golden_rows_and_swapped(
    tmp_path: Path, agent: tuple[Agent, MemoryPublisher], artifacts: Artifacts, until: Any
) -> None:
    running, publisher = agent
    assert [b[5] for b in running.process(bright(), source="test").boxes] == [1]
    update = make_tiny_detector(tmp_path / "v2.onnx", boxes=MOVED_BOX, version="det-2")
    result = deliver(running, publisher, announce(update, artifacts), until)
    assert result == {"result": "active", "version": "det-2"}
    answer = running.process(bright(), source="test")
    assert answer.model_version == "det-2" and [b[5] for b in answer.boxes] == [2]


def test_golden_rows_of_another_class_leave_the_old_detector_serving(
    tmp_path: Path, agent: tuple[Agent, MemoryPublisher], artifacts: Artifacts, until: Any
) -> None:
    running, publisher = agent
    update = make_tiny_detector(tmp_path / "v2.onnx", boxes=MOVED_BOX, version="det-2")

    def relabel(m: ModelManifest) -> ModelManifest:
        golden = m.golden[0]
        rows = [list(row) for row in golden.expected]
        for row in rows:
            row[5] = 0.0  # the settled top box's class
        return m.model_copy(update={"golden": [golden.model_copy(update={"expected": rows})]})

    result = deliver(running, publisher, announce(update, artifacts, relabel), until)
    assert result["result"] == "rejected" and result["reason"] == "golden_mismatch", result
    assert running.process(bright(), source="test").model_version == "det-1"


def test_a_classifier_offered_to_a_detector_fleet_is_refused_before_download(
    tmp_path: Path, agent: tuple[Agent, MemoryPublisher], artifacts: Artifacts, until: Any
) -> None:
    running, publisher = agent
    classifier = make_tiny_student(tmp_path / "c.onnx", size=32, version="cls-2")
    result = deliver(running, publisher, announce(classifier, artifacts), until)
    assert result["result"] == "rejected" and result["reason"] == "incompatible_task", result
    assert artifacts.requests == 0
    assert running.process(bright(), source="test").model_version == "det-1"
