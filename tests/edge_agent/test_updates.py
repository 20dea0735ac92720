"""Model updates on the agent: install, every refusal (old model keeps answering), rollback.

Announcements are built and signed as the cloud's registry does; artifacts come
from an in-memory cloud double behind an httpx MockTransport (with Range support),
and announcements reach the agent through the in-memory publisher.
"""

from __future__ import annotations

import base64
import errno
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cloud_service.registry import build_manifest
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher, make_tiny_student
from edge_agent.updates import active_model_path, offline_rollback
from edge_agent.updates.artifacts import ArtifactFetcher
from shared.manifest import FleetSigningKey, ModelManifest
from shared.messages import ModelStatus, decode_message, encode_message, sign_manifest

KEY = FleetSigningKey.generate()
OTHER_KEY = FleetSigningKey.generate()
CLOUD = "http://127.0.0.1:8080"  # a loopback cloud: the agent sends its token over http


class CloudDouble:
    """Serves artifacts by sha256 with Range; can cut the first response short."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.requests: list[dict[str, str]] = []
        self.cut_first: bool = False

    def put(self, sha: str, data: bytes) -> None:
        self.blobs[sha] = data

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(dict(request.headers))
        if request.headers.get("authorization") != "Bearer agent-token":
            return httpx.Response(401)
        data = self.blobs[request.url.path.rsplit("/", 1)[-1]]
        header = request.headers.get("range")
        if header:
            start = int(header.removeprefix("bytes=").rstrip("-"))
            if start >= len(data):
                return httpx.Response(416)
            return httpx.Response(206, content=data[start:])
        if self.cut_first:
            self.cut_first = False
            return httpx.Response(200, content=data[: len(data) // 2])  # the link broke
        return httpx.Response(200, content=data)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


def announcement(
    path: Path,
    *,
    key: FleetSigningKey = KEY,
    change: Callable[[ModelManifest], ModelManifest] | None = None,
    cloud: CloudDouble | None = None,
) -> bytes:
    data = path.read_bytes()
    manifest = build_manifest(data)
    manifest = manifest.model_copy(update={"url": f"{CLOUD}/artifacts/{manifest.sha256}"})
    if change is not None:
        manifest = change(manifest)
    if cloud is not None:
        cloud.put(manifest.sha256, data)
    return encode_message(sign_manifest(manifest, key))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    return {
        version: make_tiny_student(root / f"{version}.onnx", size=32, seed=seed, version=version)
        for version, seed in (("v2", 2), ("v3", 3))
    }


@pytest.fixture
def cloud() -> CloudDouble:
    return CloudDouble()


@pytest.fixture
def agent(
    make_settings: Callable[..., AgentSettings], cloud: CloudDouble
) -> Iterator[tuple[Agent, MemoryPublisher]]:
    settings = make_settings(
        fleet_public_key=KEY.public_key_b64,
        cloud_url=CLOUD,
        api_token="agent-token",
        update_retry_s=60.0,
    )
    publisher = MemoryPublisher()
    with Agent(
        settings, publisher=publisher, start_sources=False, model_transport=cloud.transport
    ) as running:
        yield running, publisher


def frame(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)


def statuses(publisher: MemoryPublisher) -> list[ModelStatus]:
    return [decode_message(p, ModelStatus) for p in publisher.sent("/model-status")]


def deliver(
    agent: Agent,
    publisher: MemoryPublisher,
    raw: bytes,
    until: Callable[..., bool],
    *,
    own: bool = False,
) -> dict[str, Any]:
    before = agent.updater.last_result
    topic = agent.updater.topic_agent if own else agent.updater.topic_fleet
    publisher.deliver(topic, raw)
    assert until(lambda: agent.updater.last_result is not before, timeout=20)
    result = agent.updater.last_result
    assert result is not None
    return result


def test_install_resumes_a_broken_download_and_swaps(
    agent: tuple[Agent, MemoryPublisher], cloud: CloudDouble, models: dict[str, Path], until: Any
) -> None:
    running, publisher = agent
    assert running.process(frame(), source="test").model_version == "test-1"
    cloud.cut_first = True
    result = deliver(running, publisher, announcement(models["v2"], cloud=cloud), until)
    assert result == {"result": "active", "version": "v2"}
    assert [s.state for s in statuses(publisher)] == ["downloaded", "verified", "active"]
    assert any("range" in r for r in cloud.requests), "the second request resumes with Range"
    assert running.process(frame(), source="test").model_version == "v2"
    state = json.loads((running.settings.data_dir / "models" / "state.json").read_text())
    assert state["active"]["version"] == "v2" and state["history"][0]["version"] == "test-1"
    # A restart serves the version that was active.
    assert active_model_path(running.settings).name == "tiny-student-v2.onnx"


def _flip_byte(cloud: CloudDouble) -> None:
    for sha, data in cloud.blobs.items():
        cloud.blobs[sha] = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]


def _truncate(cloud: CloudDouble) -> None:
    for sha, data in cloud.blobs.items():
        cloud.blobs[sha] = data[: len(data) - 50]


def _bad_signature(raw: bytes) -> bytes:
    doc = json.loads(raw)
    signature = bytearray(base64.b64decode(doc["signature"]))
    signature[0] ^= 1
    doc["signature"] = base64.b64encode(bytes(signature)).decode()
    return _resign(raw, doc)


def _resign(raw: bytes, doc: dict[str, Any]) -> bytes:
    # Same manifest bytes, only the signature field replaced.
    start = raw.index(b'"signature":"') + len(b'"signature":"')
    end = raw.index(b'"', start)
    return raw[:start] + doc["signature"].encode() + raw[end:]


REFUSALS = [
    ("flipped_byte", "hash_mismatch"),
    ("wrong_signature", "bad_signature"),
    ("other_key", "bad_signature"),
    ("opset", "incompatible_opset"),
    ("golden", "golden_mismatch"),
    ("truncated", "truncated"),
    ("disk_full", "disk_full"),
]


@pytest.mark.parametrize(("case", "reason"), REFUSALS, ids=[c for c, _ in REFUSALS])
def test_refusals_leave_the_old_model_serving(
    case: str,
    reason: str,
    agent: tuple[Agent, MemoryPublisher],
    cloud: CloudDouble,
    models: dict[str, Path],
    until: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running, publisher = agent
    change = None
    key = KEY
    if case == "opset":
        change = lambda m: m.model_copy(update={"opset": 99})  # noqa: E731
    elif case == "golden":

        def change(m: ModelManifest) -> ModelManifest:
            golden = m.golden[0]
            shifted = [[x + 0.25 for x in row] for row in golden.expected]
            return m.model_copy(
                update={"golden": [golden.model_copy(update={"expected": shifted})]}
            )

    elif case == "other_key":
        key = OTHER_KEY
    raw = announcement(models["v2"], key=key, change=change, cloud=cloud)
    if case == "flipped_byte":
        _flip_byte(cloud)
    elif case == "truncated":
        _truncate(cloud)
    elif case == "wrong_signature":
        raw = _bad_signature(raw)
    elif case == "disk_full":

        def full(handle: Any, chunk: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ArtifactFetcher, "_write", lambda self, h, c: full(h, c))

    result = deliver(running, publisher, raw, until)
    assert result["result"] == "rejected" and result["reason"] == reason, result
    refused = [s for s in statuses(publisher) if s.state == "rejected"]
    assert len(refused) == 1 and refused[0].reason is not None
    assert refused[0].reason.startswith(reason + ":")
    assert "active" not in [s.state for s in statuses(publisher)]
    answer = running.process(frame(), source="test")
    assert answer.model_version == "test-1"
    # Nothing half-written is left behind.
    partial = running.settings.data_dir / "models" / "partial"
    assert not any(partial.glob("*.part")) if partial.exists() else True


def test_agent_override_wins_and_withdrawal_falls_back(
    agent: tuple[Agent, MemoryPublisher], cloud: CloudDouble, models: dict[str, Path], until: Any
) -> None:
    running, publisher = agent
    assert (
        deliver(running, publisher, announcement(models["v2"], cloud=cloud), until)["version"]
        == "v2"
    )
    canary = announcement(models["v3"], cloud=cloud)
    assert deliver(running, publisher, canary, until, own=True)["version"] == "v3"
    assert running.process(frame(), source="test").model_version == "v3"
    downloads = len(cloud.requests)
    # The override withdrawn: back to the fleet's version, from disk (no download).
    result = deliver(running, publisher, b"", until, own=True)
    assert result == {"result": "active", "version": "v2"}
    assert len(cloud.requests) == downloads
    assert running.process(frame(), source="test").model_version == "v2"


def test_rollback_restores_the_previous_version(
    agent: tuple[Agent, MemoryPublisher], cloud: CloudDouble, models: dict[str, Path], until: Any
) -> None:
    running, publisher = agent
    raw = announcement(models["v2"], cloud=cloud)
    deliver(running, publisher, raw, until)
    assert running.process(frame(), source="test").model_version == "v2"
    result = running.updater.rollback()
    assert result == {"result": "rolled-back", "from": "v2", "version": "test-1"}
    assert running.process(frame(), source="test").model_version == "test-1"
    last = statuses(publisher)[-1]
    assert last.state == "rolled-back" and last.model_version == "test-1"
    # The retained announcement of v2 arrives again (reconnect): not reinstalled.
    publisher.deliver(running.updater.topic_fleet, raw + b" ")  # same content, new delivery
    assert until(lambda: running.updater.last_result["result"] == "declined", timeout=10)  # type: ignore[index]
    assert running.process(frame(), source="test").model_version == "test-1"
    with pytest.raises(Exception, match="no earlier model"):
        running.updater.rollback()


def test_offline_rollback_edits_the_state(
    agent: tuple[Agent, MemoryPublisher], cloud: CloudDouble, models: dict[str, Path], until: Any
) -> None:
    running, publisher = agent
    deliver(running, publisher, announcement(models["v2"], cloud=cloud), until)
    deliver(running, publisher, announcement(models["v3"], cloud=cloud), until)
    previous = offline_rollback(running.settings)
    assert previous.version == "v2"
    assert active_model_path(running.settings).name == "tiny-student-v2.onnx"
