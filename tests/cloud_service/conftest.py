"""Fixtures of the cloud service tests: a teacher-like model, settings, sample envelopes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.settings import CloudSettings
from shared.envelope import encode_envelope
from shared.messages import SampleHeader
from shared.mqtt import make_client
from shared.topics import Topics
from simulations.samples import CLASSES, SIZE, image_bytes
from simulations.samples import sample_header as make_header

SAFETY_NET_S = 30.0  # how long a wait on the broker may take before the test gives up


@pytest.fixture(scope="session")
def teacher_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small teacher-like ONNX model (seeded), built once per session."""
    path = tmp_path_factory.mktemp("teacher") / "teacher.onnx"
    return build_demo_teacher(path, size=SIZE, classes=CLASSES, hidden=128, seed=1)


@pytest.fixture
def make_settings(tmp_path: Path, teacher_path: Path) -> Callable[..., CloudSettings]:
    """Settings for a test: its own data dir, the test teacher, quick batching."""

    def make(**overrides: Any) -> CloudSettings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "teacher_model": teacher_path,
            "max_queue_delay_ms": 2.0,
            "blob_fsync": False,
            "review_audit_share": 0.0,
        }
        values.update(overrides)
        return CloudSettings(**values)

    return make


_DEAD_BLOB_WRITER = """
import json, os, sys
from cloud_service.blobs import LocalBlobStore
store = LocalBlobStore(sys.argv[1], fsync=True)
settled = set(json.loads(sys.argv[3]))
written = []
for i, blobs in enumerate(json.loads(sys.argv[2])):
    batch = store.batch([(f"samples/f/a/{i}-{j}.jpg", b.encode()) for j, b in enumerate(blobs)])
    batch.write()
    if i in settled:
        batch.settle()  # what points at it committed
    written.append(batch.keys)
print(json.dumps(written), flush=True)
os._exit(3)  # dies: no close, no cleanup
"""


def dead_blob_writer(
    root: Path, batches: list[list[str]], *, settled: Collection[int] = ()
) -> list[list[str]]:
    """The keys of ``batches`` (each a list of blobs, as text) written into the local
    blob store at ``root`` by a process that then died, having settled the batches
    numbered in ``settled`` only."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _DEAD_BLOB_WRITER,
            str(root),
            json.dumps(batches),
            json.dumps(sorted(settled)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    written: list[list[str]] = json.loads(done.stdout)
    return written


def wait_until(predicate: Callable[[], Any], timeout: float, step: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def make_envelope(**kwargs: Any) -> tuple[SampleHeader, bytes]:
    image = kwargs.pop("image", None) or image_bytes(kwargs.get("size", SIZE))
    header = make_header(image, **kwargs)
    return header, encode_envelope(header, image)


class Collector:
    """A plain MQTT subscriber that gathers messages by topic."""

    def __init__(self, url: str, filters: list[str], protocol: str) -> None:
        from shared.mqtt import MqttTarget

        target = MqttTarget.parse(url)
        self.messages: list[tuple[str, bytes]] = []
        self._subacked: set[int] = set()
        self._subscribed = threading.Condition()
        self.client = make_client(
            target,
            client_id=f"collector-{time.monotonic_ns()}",
            protocol=protocol,  # type: ignore[arg-type]
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.connect(target.host, target.port)
        self.client.loop_start()
        mids: set[int] = set()
        for topic in filters:
            result, mid = self.client.subscribe(topic, qos=1)
            assert result == mqtt.MQTT_ERR_SUCCESS
            mids.add(mid)
        with self._subscribed:  # the broker has acknowledged every subscription
            assert self._subscribed.wait_for(lambda: mids <= self._subacked, SAFETY_NET_S)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, *args: Any) -> None:
        with self._subscribed:
            self._subacked.add(mid)
            self._subscribed.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.messages.append((message.topic, bytes(message.payload)))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
        return wait_until(predicate, timeout, step=0.02)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def collector_factory() -> Iterator[Callable[..., Collector]]:
    made: list[Collector] = []

    def make(url: str, filters: list[str], protocol: str) -> Collector:
        collector = Collector(url, filters, protocol)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def publisher(url: str, protocol: str) -> mqtt.Client:
    from shared.mqtt import MqttTarget

    target = MqttTarget.parse(url)
    client = make_client(
        target,
        client_id=f"pub-{time.monotonic_ns()}",
        protocol=protocol,  # type: ignore[arg-type]
    )
    client.max_inflight_messages_set(1000)
    client.connect(target.host, target.port)
    client.loop_start()
    return client


def topic_prefix(topics: Topics) -> str:
    return topics.prefix
