"""The link finds the broker's MQTT version on its own connection, never with a probe."""

from __future__ import annotations

import queue
import uuid
from typing import Any

import pytest

from edge_agent.uplink import MqttLink
from shared.broker import EmbeddedBroker
from shared.mqtt import MqttTarget

pytestmark = [pytest.mark.mqtt]


def _round_trip(target: MqttTarget) -> tuple[MqttLink, bytes]:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/echo"
    received: queue.Queue[bytes] = queue.Queue()
    link = MqttLink(
        target, client_id=f"edgeloop-test-{uuid.uuid4().hex[:8]}", subscriptions=[topic]
    )
    link.set_handlers(on_message=lambda t, p: received.put(p), on_connect=lambda: None)
    link.start()
    link.wait_ready(30)  # connected, the subscription acknowledged
    link.publish(topic, b"echo")
    return link, received.get(timeout=30)


def test_a_v5_broker_is_spoken_to_in_v5_with_one_connection(broker: Any) -> None:
    if broker.protocol != "5":
        pytest.skip("the test broker does not speak MQTT v5")
    link, echoed = _round_trip(broker.target)
    try:
        assert echoed == b"echo"
        assert link.protocol == "5" and link.connects == 1
    finally:
        link.stop()


def test_a_311_broker_gets_311_after_v5_goes_unanswered(embedded_broker: EmbeddedBroker) -> None:
    link, echoed = _round_trip(MqttTarget.parse(embedded_broker.url))
    try:
        assert echoed == b"echo"
        assert link.protocol == "3.1.1" and link.connects == 1
    finally:
        link.stop()
