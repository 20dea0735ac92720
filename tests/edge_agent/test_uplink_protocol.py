"""The link finds the broker's MQTT version on its own connection, never with a probe."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from edge_agent.uplink import MqttLink
from shared.broker import EmbeddedBroker
from shared.mqtt import MqttTarget
from tests.cloud_service.conftest import wait_until

pytestmark = [pytest.mark.mqtt]


def _round_trip(target: MqttTarget) -> tuple[MqttLink, list[bytes]]:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/echo"
    received: list[bytes] = []
    link = MqttLink(
        target, client_id=f"edgeloop-test-{uuid.uuid4().hex[:8]}", subscriptions=[topic]
    )
    link.set_handlers(on_message=lambda t, p: received.append(p), on_connect=lambda: None)
    link.start()
    assert wait_until(lambda: link.connected, 30)

    def echoed() -> bool:
        if not received:
            link.publish(topic, b"echo")
        return bool(received)

    assert wait_until(echoed, 20, step=0.1)
    return link, received


def test_a_v5_broker_is_spoken_to_in_v5_with_one_connection(broker: Any) -> None:
    if broker.protocol != "5":
        pytest.skip("the test broker does not speak MQTT v5")
    link, _ = _round_trip(broker.target)
    try:
        assert link.protocol == "5" and link.connects == 1
    finally:
        link.stop()


def test_a_311_broker_gets_311_after_v5_goes_unanswered(embedded_broker: EmbeddedBroker) -> None:
    link, _ = _round_trip(MqttTarget.parse(embedded_broker.url))
    try:
        assert link.protocol == "3.1.1" and link.connects == 1
    finally:
        link.stop()
