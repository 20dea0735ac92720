"""MQTT helpers against real brokers: the machine's (or embedded) and the embedded one."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from shared.broker import EmbeddedBroker
from shared.errors import TransportError
from shared.mqtt import MqttTarget, make_client, negotiate_protocol
from shared.topics import Topics

pytestmark = pytest.mark.mqtt


def _round_trip(target: MqttTarget, protocol: str, topic: str, payload: bytes) -> bytes:
    received: list[bytes] = []
    got = threading.Event()
    subscribed = threading.Event()
    sub = make_client(target, client_id=f"sub-{topic[-12:]}", protocol=protocol)  # type: ignore[arg-type]

    def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        received.append(message.payload)
        got.set()

    sub.on_message = on_message
    sub.on_subscribe = lambda *args: subscribed.set()
    sub.connect(target.host, target.port)
    sub.loop_start()
    pub = make_client(target, client_id=f"pub-{topic[-12:]}", protocol=protocol)  # type: ignore[arg-type]
    try:
        sub.subscribe(topic, qos=1)
        assert subscribed.wait(5)
        pub.connect(target.host, target.port)
        pub.loop_start()
        pub.publish(topic, payload, qos=1).wait_for_publish(5)
        assert got.wait(5), "message not delivered"
    finally:
        pub.disconnect()
        pub.loop_stop()
        sub.disconnect()
        sub.loop_stop()
    return received[0]


def test_round_trip_on_the_test_broker(broker: Any, topics: Topics) -> None:
    payload = bytes(range(256)) * 80
    topic = topics.samples("fleet-a", "cam-1")
    assert _round_trip(broker.target, broker.protocol, topic, payload) == payload


def test_embedded_broker_speaks_311_and_delivers(
    embedded_broker: EmbeddedBroker, topics: Topics
) -> None:
    target = MqttTarget.parse(embedded_broker.url)
    assert negotiate_protocol(target) == "3.1.1"
    topic = topics.verdicts("fleet-a", "cam-1")
    assert _round_trip(target, "3.1.1", topic, b"verdict") == b"verdict"


def test_clients_set_tcp_nodelay(broker: Any) -> None:
    target = broker.target
    client = make_client(target, client_id="nodelay-check", protocol=broker.protocol)
    connected = threading.Event()
    client.on_connect = lambda *args: connected.set()
    client.connect(target.host, target.port)
    client.loop_start()
    try:
        assert connected.wait(5)
        sock = client.socket()
        assert sock is not None
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        client.disconnect()
        client.loop_stop()


def test_unreachable_broker_is_a_transport_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransportError, match="cannot reach"):
        negotiate_protocol(MqttTarget.parse(f"mqtt://127.0.0.1:{port}"))


def test_target_parsing_hides_passwords() -> None:
    target = MqttTarget.parse("mqtts://cam%201:p%40ss@broker.example")
    assert (target.username, target.password, target.port, target.tls) == (
        "cam 1",
        "p@ss",
        8883,
        True,
    )
    assert "p@ss" not in repr(target)


def _accepted(broker: EmbeddedBroker, sock: socket.socket) -> bool:
    """Whether the broker's event loop holds the server side of ``sock``'s connection."""

    async def held() -> bool:
        transports = getattr(asyncio.get_running_loop(), "_transports", {})
        return any(
            t is not None and t.get_extra_info("peername") == sock.getsockname()
            for t in list(transports.values())
        )

    loop = broker._loop
    assert loop is not None
    return asyncio.run_coroutine_threadsafe(held(), loop).result(30)


def _wait_until_accepted(broker: EmbeddedBroker, sock: socket.socket) -> None:
    pause = threading.Event()
    for _ in range(3000):  # a safety net of 30 s: it is accepted within moments
        if _accepted(broker, sock):
            return
        pause.wait(0.01)
    raise AssertionError("the broker never accepted the connection")


def test_the_embedded_broker_leaves_no_connection_open() -> None:
    """amqtt keeps a connection open when it ends before a valid CONNECT (a port
    probe, a refused protocol version): the embedded broker closes it, and closes what
    is still open when it stops, so no writer is left for the garbage collector (which
    warns, in whatever code runs then)."""
    import gc
    import sys
    import warnings

    unraisable: list[Any] = []
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        try:
            broker = EmbeddedBroker().start()
            socket.create_connection((broker.host, broker.port)).close()  # a port probe
            assert negotiate_protocol(MqttTarget.parse(broker.url)) == "3.1.1"  # v5 refused
            stays = socket.create_connection((broker.host, broker.port))  # open at the stop
            _wait_until_accepted(broker, stays)
            broker.stop()
            stays.close()
            gc.collect()
        finally:
            sys.unraisablehook = hook
    leaks = [str(w.message) for w in recorded if issubclass(w.category, ResourceWarning)]
    assert leaks == []
    assert unraisable == []
