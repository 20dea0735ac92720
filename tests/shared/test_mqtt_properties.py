"""paho's MQTT v5 properties with the cheap steps: the same objects, bytes and refusals."""

from __future__ import annotations

import threading
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import MQTTException, Properties

from shared import mqtt_properties
from shared.mqtt import make_client
from shared.topics import Topics

PAYLOAD = bytes(range(256)) * 80


def _reference(packet_type: int) -> Properties:
    """A ``Properties`` built by paho's own ``__init__``."""
    props = Properties.__new__(Properties)
    mqtt_properties.ORIGINAL["__init__"](props, packet_type)
    return props


def _publish_properties(props: Properties) -> Properties:
    props.MessageExpiryInterval = 60
    props.ContentType = "image/jpeg"
    props.PayloadFormatIndicator = 0
    props.CorrelationData = b"\x00\x01id"
    props.UserProperty = ("fleet", "plant-3")
    props.UserProperty = ("agent", "cam-1")
    props.SubscriptionIdentifier = 7
    return props


@pytest.fixture(scope="module", autouse=True)
def _installed() -> None:
    assert mqtt_properties.install()
    assert mqtt_properties.installed()
    # The comparisons below set paho's own steps against the cheap ones, never against
    # themselves.
    for name, original in mqtt_properties.ORIGINAL.items():
        assert getattr(Properties, name) is not original


def test_a_built_properties_has_pahos_tables_and_packs_the_same_bytes() -> None:
    fast, reference = Properties(PacketTypes.PUBLISH), _reference(PacketTypes.PUBLISH)
    for name in ("packetType", "types", "names", "properties"):
        assert getattr(fast, name) == getattr(reference, name)
    assert fast.isEmpty() and fast.pack() == reference.pack() == b"\x00"
    assert _publish_properties(fast).pack() == _publish_properties(reference).pack()
    assert fast.json() == reference.json() and str(fast) == str(reference)


def test_unpacking_reads_the_same_values_and_length_as_paho() -> None:
    packed = _publish_properties(Properties(PacketTypes.PUBLISH)).pack()
    for kind in (bytes, bytearray):
        fast, length = Properties(PacketTypes.PUBLISH).unpack(kind(packed + PAYLOAD))
        reference, reference_length = mqtt_properties.ORIGINAL["unpack"](
            _reference(PacketTypes.PUBLISH), kind(packed + PAYLOAD)
        )
        assert length == reference_length == len(packed)
        assert fast.json() == reference.json()
        assert fast.UserProperty == [("fleet", "plant-3"), ("agent", "cam-1")]


def test_an_empty_property_list_reads_as_one_byte_and_clears_what_was_set() -> None:
    props = _publish_properties(Properties(PacketTypes.PUBLISH))
    got, length = props.unpack(b"\x00" + PAYLOAD)
    assert got is props and length == 1 and props.isEmpty()
    assert not hasattr(props, "UserProperty") and props.packetType == PacketTypes.PUBLISH
    with pytest.raises(Exception) as reference:
        mqtt_properties.ORIGINAL["unpack"](_reference(PacketTypes.PUBLISH), b"")
    with pytest.raises(reference.type):  # nothing at all: paho's own error, as before
        Properties(PacketTypes.PUBLISH).unpack(b"")


def test_names_and_values_paho_refuses_are_still_refused() -> None:
    props = Properties(PacketTypes.PUBLISH)
    with pytest.raises(MQTTException, match="must be one of"):
        props.NotAProperty = 1
    with pytest.raises(MQTTException, match="does not apply"):
        props.SessionExpiryInterval = 10  # a CONNECT property
    with pytest.raises(MQTTException, match="0 or 1"):
        props.PayloadFormatIndicator = 2
    # Tables are shared between instances, never written: a second one is unaffected.
    assert Properties(PacketTypes.CONNECT).packetType == PacketTypes.CONNECT
    assert Properties(PacketTypes.PUBLISH).isEmpty()


@pytest.mark.mqtt
def test_a_v5_publish_with_properties_arrives_with_them(broker: Any, topics: Topics) -> None:
    if broker.protocol != "5":
        pytest.skip("the broker under test speaks MQTT 3.1.1 only")
    target = broker.target
    topic = topics.samples("fleet-a", "cam-props")
    received: list[mqtt.MQTTMessage] = []
    got, subscribed = threading.Event(), threading.Event()
    sub = make_client(target, client_id="props-sub", protocol="5")
    pub = make_client(target, client_id="props-pub", protocol="5")

    def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        received.append(message)
        got.set()

    sub.on_message = on_message
    sub.on_subscribe = lambda *args: subscribed.set()
    sub.connect(target.host, target.port)
    sub.loop_start()
    try:
        sub.subscribe(topic, qos=1)
        assert subscribed.wait(5)
        pub.connect(target.host, target.port)
        pub.loop_start()
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "image/jpeg"
        props.UserProperty = ("fleet", "plant-3")
        pub.publish(topic, PAYLOAD, qos=1, properties=props).wait_for_publish(5)
        pub.publish(topic, b"plain", qos=1).wait_for_publish(5)
        assert got.wait(5)
        while len(received) < 2:
            got.clear()
            assert got.wait(5)
    finally:
        pub.disconnect()
        pub.loop_stop()
        sub.disconnect()
        sub.loop_stop()
    first, second = received
    assert first.payload == PAYLOAD and first.properties.ContentType == "image/jpeg"
    assert first.properties.UserProperty == [("fleet", "plant-3")]
    assert second.payload == b"plain" and second.properties.isEmpty()
