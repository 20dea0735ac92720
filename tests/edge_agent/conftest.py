"""Fixtures for the edge agent: a tiny student model, settings, images, a cloud double."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from PIL import Image

from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.settings import AgentSettings
from edge_agent.testing import make_tiny_student
from shared.envelope import decode_envelope
from shared.messages import Receipt, encode_message
from shared.mqtt import MqttTarget, make_client
from shared.topics import Topics

MODEL_SIZE = 32


@pytest.fixture(scope="session")
def student_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny student on the model contract, built once per session."""
    return make_tiny_student(tmp_path_factory.mktemp("models") / "student.onnx", size=MODEL_SIZE)


@pytest.fixture(scope="session")
def engine(student_path: Path) -> OrtEngine:
    return OrtEngine(student_path, EngineOptions(intra_op_threads=1, warmup_runs=1))


def image_bytes(width: int = 64, height: int = 48, *, fmt: str = "JPEG", seed: int = 0) -> bytes:
    """A random-ish image encoded as JPEG or PNG."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture
def make_settings(tmp_path: Path, student_path: Path) -> Callable[..., AgentSettings]:
    """AgentSettings in this test's tmp dir; keyword arguments override."""

    def build(**overrides: Any) -> AgentSettings:
        values: dict[str, Any] = {
            "data_dir": tmp_path,
            "model_path": student_path,
            "fleet": "test-fleet",
            "agent_id": "agent-1",
            "intra_op_threads": 1,
            "warmup_runs": 1,
            "max_wait_ms": 2.0,
            "heartbeat_s": 1.0,
            "audit_share": 0.0,
            "resend_after_s": 30.0,
            "reconnect_min_s": 0.1,
            "reconnect_max_s": 0.5,
        }
        values.update(overrides)
        return AgentSettings(**values)

    return build


class FakeCloud:
    """Plays the cloud on a real broker: stores samples by id and sends receipts back.

    ``received`` counts every MQTT delivery; ``stored`` the distinct ids, as the real
    cloud (which stores by sample_id) would.
    """

    def __init__(self, url: str, topics: Topics, fleet: str, agent: str, *, receipts: bool = True):
        self.topics = topics
        self.fleet, self.agent = fleet, agent
        self.send_receipts = receipts
        self.received: list[str] = []
        self.stored: set[str] = set()
        self._lock = threading.Lock()
        self.connected = threading.Event()
        target = MqttTarget.parse(url)
        self.client = make_client(
            target, client_id=f"fake-cloud-{fleet}-{agent}", protocol="5", clean_start=False
        )
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda *a: self.connected.clear()
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect_async(target.host, target.port, 10, clean_start=False, properties=props)
        self.client.reconnect_delay_set(0.1, 0.5)

    def __enter__(self) -> FakeCloud:
        self.client.loop_start()
        assert self.connected.wait(10), "fake cloud could not connect"
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, rc: Any, props: Any
    ) -> None:
        client.subscribe(self.topics.samples(self.fleet, self.agent), qos=1)
        self.connected.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        envelope = decode_envelope(message.payload)
        sample_id = envelope.header.sample_id
        with self._lock:
            self.received.append(sample_id)
            self.stored.add(sample_id)
        if self.send_receipts:
            receipt = Receipt(sample_ids=[sample_id], stored_at=datetime.now(UTC))
            client.publish(
                self.topics.receipts(self.fleet, self.agent), encode_message(receipt), qos=1
            )

    @property
    def duplicates(self) -> int:
        with self._lock:
            return len(self.received) - len(self.stored)


@pytest.fixture
def fake_cloud_factory() -> Iterator[Callable[..., FakeCloud]]:
    clouds: list[FakeCloud] = []

    def make(url: str, topics: Topics, *, receipts: bool = True) -> FakeCloud:
        cloud = FakeCloud(url, topics, "test-fleet", "agent-1", receipts=receipts).__enter__()
        clouds.append(cloud)
        return cloud

    yield make
    for cloud in clouds:
        cloud.__exit__()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (bounded)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


@pytest.fixture
def make_image() -> Callable[..., bytes]:
    """``make_image(width, height, fmt="JPEG"|"PNG", seed=0)`` -> encoded bytes."""
    return image_bytes


@pytest.fixture
def until() -> Callable[..., bool]:
    """``until(predicate, timeout)``: poll until true (bounded)."""
    return wait_for
