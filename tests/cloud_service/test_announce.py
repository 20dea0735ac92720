"""The MQTT announcer against a real broker: retained, acknowledged, reconnected on use."""

from __future__ import annotations

import queue
import uuid
from typing import Any

import pytest

from cloud_service.announce import MqttAnnouncer
from shared.broker import free_port
from shared.errors import TransportError
from shared.mqtt import MqttTarget, Received, Subscription
from shared.mqtt_connection import MqttConnection

pytestmark = pytest.mark.mqtt

SAFETY_NET_S = 30.0  # only bounds a hang


def _retained(target: MqttTarget, topic: str) -> Received:
    """What a fresh subscriber of ``topic`` is handed first (the retained message)."""
    got: queue.Queue[Received] = queue.Queue()
    reader = MqttConnection(
        target,
        client_id=f"edgeloop-test-reader-{uuid.uuid4().hex[:8]}",
        subscriptions=[Subscription(topic, got.put)],
        persistent=False,
    )
    reader.start()
    try:
        reader.wait_ready(SAFETY_NET_S)
        return got.get(timeout=SAFETY_NET_S)
    finally:
        reader.stop()


def test_an_announcement_is_retained_and_a_closed_announcer_connects_again(broker: Any) -> None:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/models"
    announcer = MqttAnnouncer(broker.target, client_id="edgeloop-test-announcer")
    try:
        announcer.announce(topic, b"model v1")
        assert _retained(broker.target, topic).payload == b"model v1"
        announcer.close()
        announcer.announce(topic, b"model v2")  # a new connection on use
        assert _retained(broker.target, topic).payload == b"model v2"
        announcer.announce(topic, b"")  # cleared
    finally:
        announcer.close()
    announcer.close()  # twice: nothing to do


def test_an_unreachable_broker_is_a_transport_error_at_once() -> None:
    target = MqttTarget.parse(f"mqtt://127.0.0.1:{free_port()}")  # nothing listens there
    announcer = MqttAnnouncer(target, timeout_s=SAFETY_NET_S)
    with pytest.raises(TransportError, match="cannot reach"):
        announcer.announce("edgeloop-test/x/models", b"model")
    announcer.close()
