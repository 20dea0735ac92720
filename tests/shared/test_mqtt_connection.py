"""MqttConnection against a real broker: subscriptions, acks, deliveries, and a stop that
cannot race (several threads at once, during a reconnect, from a handler).

Every wait is on an event, a queue or the connection's own ``wait_ready``; none
sleeps for a condition. The takeover tests need the machine's Mosquitto (1883).
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from shared.broker import EmbeddedBroker, free_port
from shared.errors import TransportError
from shared.mqtt import MqttTarget, Received, Subscription, make_client
from shared.mqtt_connection import MqttConnection

pytestmark = pytest.mark.mqtt

SAFETY_NET_S = 30.0  # only bounds a hang; nothing is timed against it


def _name(what: str) -> str:
    return f"edgeloop-test-{what}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def mosquitto_target(broker: Any) -> MqttTarget:
    if broker.kind != "mosquitto":
        pytest.skip("needs the machine's Mosquitto at 127.0.0.1:1883")
    target: MqttTarget = broker.target
    return target


@pytest.fixture
def raised() -> Iterator[list[BaseException]]:
    """Exceptions any thread raised during the test (threading.excepthook)."""
    seen: list[BaseException] = []
    hook = threading.excepthook

    def record(args: threading.ExceptHookArgs) -> None:
        seen.append(args.exc_value or RuntimeError(str(args.exc_type)))
        hook(args)

    threading.excepthook = record
    try:
        yield seen
    finally:
        threading.excepthook = hook


class _Counted:
    """An on_connect/on_disconnect hook with one event per call."""

    def __init__(self, calls: int = 4) -> None:
        self.events = [threading.Event() for _ in range(calls)]
        self.count = 0

    def __call__(self) -> None:
        if self.count < len(self.events):
            self.events[self.count].set()
        self.count += 1

    def wait(self, nth: int) -> bool:
        return self.events[nth - 1].wait(SAFETY_NET_S)


def _publisher(target: MqttTarget) -> MqttConnection:
    connection = MqttConnection(target, client_id=_name("pub"), persistent=False, name="test-pub")
    connection.start().wait_ready(SAFETY_NET_S)
    return connection


def _send(target: MqttTarget, topic: str, payload: bytes) -> None:
    publisher = _publisher(target)
    try:
        assert publisher.deliver(topic, payload, qos=1).wait(SAFETY_NET_S)
    finally:
        publisher.stop()


def _take_over(target: MqttTarget, client_id: str) -> None:
    """Connect under ``client_id`` (the broker drops the connection holding it), then leave."""
    connected = threading.Event()
    intruder = make_client(target, client_id=client_id, protocol="3.1.1")
    intruder.on_connect = lambda *args: connected.set()
    intruder.connect(target.host, target.port)
    intruder.loop_start()
    try:
        assert connected.wait(SAFETY_NET_S)
    finally:
        intruder.disconnect()
        intruder.loop_stop()


def _stop_all_at_once(connection: MqttConnection, threads: int = 8) -> list[threading.Thread]:
    barrier = threading.Barrier(threads)

    def stop() -> None:
        barrier.wait(SAFETY_NET_S)
        connection.stop(timeout=SAFETY_NET_S)

    stoppers = [threading.Thread(target=stop) for _ in range(threads)]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(SAFETY_NET_S)
    return stoppers


def test_a_message_reaches_its_subscriptions_handler_and_a_delivery_its_puback(
    broker: Any,
) -> None:
    target = broker.target
    base = f"edgeloop-test/{uuid.uuid4().hex[:8]}"
    samples: queue.Queue[Received] = queue.Queue()
    statuses: queue.Queue[Received] = queue.Queue()
    connection = MqttConnection(
        target,
        client_id=_name("handlers"),
        subscriptions=[
            Subscription(f"{base}/+/samples", samples.put),
            Subscription(f"{base}/+/status", statuses.put),
        ],
        persistent=False,
    )
    connection.start()
    try:
        connection.wait_ready(SAFETY_NET_S)
        _send(target, f"{base}/cam-1/status", b"online")
        _send(target, f"{base}/cam-1/samples", b"sample")
        assert samples.get(timeout=SAFETY_NET_S).payload == b"sample"
        status = statuses.get(timeout=SAFETY_NET_S)
        assert (status.topic, status.payload, status.qos) == (f"{base}/cam-1/status", b"online", 1)
        assert samples.empty() and statuses.empty()
        assert connection.protocol == broker.protocol and connection.connects == 1
    finally:
        connection.stop()
    assert connection.health()["alive"] is False


def test_a_publish_costs_the_wait_that_wakes_for_it_and_the_one_for_its_puback(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a wake-up hands over is written in the same pass of the io loop: no third
    wait just for the socket to take it (the loop waited three times per publish)."""
    import shared.mqtt_connection as module

    # module.select is the select module itself: the patch sees every thread's select,
    # and counts the publisher's io thread only.
    waits = 0
    real_select = module.select.select

    def counted(*args: Any) -> Any:
        nonlocal waits
        if threading.current_thread().name == "test-pub-io":
            waits += 1
        return real_select(*args)

    publisher = _publisher(broker.target)
    try:
        monkeypatch.setattr(module.select, "select", counted)
        topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/samples"
        count = 20
        for _ in range(count):  # one at a time: each wakes the idle loop, as a sparse sample
            assert publisher.deliver(topic, b"x" * 20_000, qos=1).wait(SAFETY_NET_S)
    finally:
        publisher.stop()
    # Two waits per publish (three before: 60 here). A machine stalled past the loop's
    # 1 s keepalive timeout adds a wait per stall; the margin allows ten.
    assert waits <= 2 * count + 10


def test_the_packets_one_read_brings_are_handled_in_the_pass_that_read_them(
    mosquitto_target: MqttTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst that arrived while a handler ran is handled in a pass or two, not a pass
    of the io loop per packet (each pass: keepalive checks, the queue, the wake-up)."""
    import shared.mqtt_connection as module

    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/verdicts"
    count = 30
    got: queue.Queue[bytes] = queue.Queue()
    entered, gate = threading.Event(), threading.Event()

    def handler(message: Received) -> None:
        entered.set()
        assert gate.wait(SAFETY_NET_S), "the test never released the handler"
        got.put(message.payload)

    passes = 0
    real_pass = module.MqttConnection._pass

    def counted(self: Any, client: Any, sock: Any) -> Any:
        nonlocal passes
        if gate.is_set() and threading.current_thread().name == "test-sub-io":
            passes += 1
        return real_pass(self, client, sock)

    monkeypatch.setattr(module.MqttConnection, "_pass", counted)
    subscriber = MqttConnection(
        mosquitto_target,
        client_id=_name("sub"),
        subscriptions=[Subscription(topic, handler, qos=0)],
        persistent=False,
        name="test-sub",
    )
    subscriber.start().wait_ready(SAFETY_NET_S)
    publisher = _publisher(mosquitto_target)
    try:
        assert publisher.deliver(topic, b"first", qos=1).wait(SAFETY_NET_S)
        assert entered.wait(SAFETY_NET_S)  # the io thread is in the handler
        for i in range(count):  # each PUBACK: the broker routed it to the subscriber
            assert publisher.deliver(topic, b"%d" % i, qos=1).wait(SAFETY_NET_S)
        gate.set()
        received = [got.get(timeout=SAFETY_NET_S) for _ in range(count + 1)]
    finally:
        gate.set()
        publisher.stop()
        subscriber.stop()
    assert received == [b"first"] + [b"%d" % i for i in range(count)]
    # A pass per packet before: 30 or more. A burst split over two reads takes two.
    assert passes <= 10


def test_a_shared_subscription_on_v5(mosquitto_target: MqttTarget, broker: Any) -> None:
    if broker.protocol != "5":
        pytest.skip("shared subscriptions need MQTT v5")
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/samples"
    got: queue.Queue[Received] = queue.Queue()
    subscription = Subscription(topic, got.put, shared_group="verifiers")
    assert subscription.resolved("5") == f"$share/verifiers/{topic}"
    assert subscription.resolved("3.1.1") == topic
    connection = MqttConnection(
        mosquitto_target, client_id=_name("shared"), subscriptions=[subscription], persistent=False
    )
    connection.start()
    try:
        connection.wait_ready(SAFETY_NET_S)
        _send(mosquitto_target, topic, b"one")
        assert got.get(timeout=SAFETY_NET_S).payload == b"one"
    finally:
        connection.stop()


def test_an_unacked_message_comes_again_and_an_acked_one_does_not(
    mosquitto_target: MqttTarget,
) -> None:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/samples"
    client_id = _name("acks")

    def session(handler: Callable[[Received], None]) -> MqttConnection:
        connection = MqttConnection(
            mosquitto_target,
            client_id=client_id,
            subscriptions=[Subscription(topic, handler)],
            session_expiry_s=60,
            manual_ack=True,
        )
        connection.start().wait_ready(SAFETY_NET_S)
        return connection

    got: queue.Queue[Received] = queue.Queue()
    first = session(got.put)
    _send(mosquitto_target, topic, b"first")
    assert got.get(timeout=SAFETY_NET_S).payload == b"first"
    first.stop()  # never acked: the session keeps it for us

    again = session(got.put)
    redelivered = got.get(timeout=SAFETY_NET_S)
    assert redelivered.payload == b"first"
    again.ack(redelivered.mid, redelivered.qos)
    again.stop()  # the ack is written before the DISCONNECT

    _send(mosquitto_target, topic, b"marker")
    last = session(got.put)
    try:
        assert got.get(timeout=SAFETY_NET_S).payload == b"marker"  # not "first" again
    finally:
        last.stop()
        cleanup = MqttConnection(mosquitto_target, client_id=client_id, persistent=False)
        cleanup.start().wait_ready(SAFETY_NET_S)  # a clean start ends the session
        cleanup.stop()


def test_every_reconnect_subscribes_again(mosquitto_target: MqttTarget) -> None:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/verdicts"
    client_id = _name("resubscribe")
    got: queue.Queue[Received] = queue.Queue()
    connects, disconnects = _Counted(), _Counted()
    connection = MqttConnection(
        mosquitto_target,
        client_id=client_id,
        subscriptions=[Subscription(topic, got.put)],
        on_connect=connects,
        on_disconnect=disconnects,
        persistent=False,  # the intruder's clean start would end a session anyway
        backoff_min_s=0.05,
        backoff_max_s=0.1,
    )
    connection.start()
    try:
        assert connects.wait(1)
        _take_over(mosquitto_target, client_id)
        assert disconnects.wait(1)
        assert connects.wait(2)
        connection.wait_ready(SAFETY_NET_S)  # the new SUBACK
        _send(mosquitto_target, topic, b"after the reconnect")
        assert got.get(timeout=SAFETY_NET_S).payload == b"after the reconnect"
        assert connection.connects >= 2 and connection.disconnects >= 1
    finally:
        connection.stop()


def test_stop_from_several_threads_at_once(
    mosquitto_target: MqttTarget, raised: list[BaseException]
) -> None:
    connection = MqttConnection(mosquitto_target, client_id=_name("stops"), persistent=False)
    connection.start().wait_ready(SAFETY_NET_S)
    connection.publish("edgeloop-test/stops", b"in flight while stopping")
    stoppers = _stop_all_at_once(connection)
    assert not any(thread.is_alive() for thread in stoppers)
    assert connection.health()["alive"] is False and not connection.connected
    connection.stop()  # once more: nothing to do
    connection.publish("edgeloop-test/stops", b"after the stop")  # dropped, no paho call
    connection.ack(1, 1)
    assert not connection.deliver("edgeloop-test/stops", b"late").wait(0)
    assert raised == []


def test_stop_during_the_backoff_after_a_lost_connection(
    mosquitto_target: MqttTarget, raised: list[BaseException]
) -> None:
    client_id = _name("backoff")
    connects, disconnects = _Counted(), _Counted()
    connection = MqttConnection(
        mosquitto_target,
        client_id=client_id,
        on_connect=connects,
        on_disconnect=disconnects,
        persistent=False,
        backoff_min_s=600.0,  # the next attempt is minutes away: only stop() can end the wait
        backoff_max_s=600.0,
    )
    connection.start()
    assert connects.wait(1)
    _take_over(mosquitto_target, client_id)
    assert disconnects.wait(1)  # the io thread goes on to its backoff now
    stoppers = _stop_all_at_once(connection)
    assert not any(thread.is_alive() for thread in stoppers)
    assert connection.health()["alive"] is False
    assert raised == []


def test_stop_while_the_broker_cannot_be_reached(raised: list[BaseException]) -> None:
    target = MqttTarget.parse(f"mqtt://127.0.0.1:{free_port()}")  # nothing listens there
    connection = MqttConnection(target, client_id=_name("unreachable"), backoff_min_s=0.01)
    connection.start()
    with pytest.raises(TransportError, match="cannot reach"):
        connection.wait_ready(SAFETY_NET_S)  # at once: the attempt was refused
    stoppers = _stop_all_at_once(connection)
    assert not any(thread.is_alive() for thread in stoppers)
    assert connection.health()["alive"] is False
    assert raised == []


def test_start_and_stop_racing_leave_no_thread(broker: Any, raised: list[BaseException]) -> None:
    for _ in range(5):
        connection = MqttConnection(broker.target, client_id=_name("race"), persistent=False)
        barrier = threading.Barrier(4)

        def act(call: Callable[[], object], barrier: threading.Barrier) -> None:
            barrier.wait(SAFETY_NET_S)
            call()

        calls: list[Callable[[], object]] = [connection.start, connection.stop] * 2
        threads = [threading.Thread(target=act, args=(call, barrier)) for call in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SAFETY_NET_S)
        connection.stop()
        assert connection.health()["alive"] is False
        connection.start()  # a stopped connection does not start again
        assert connection.health()["alive"] is False
    assert raised == []


def test_stop_from_a_handler_ends_the_connection_without_a_deadlock(broker: Any) -> None:
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/stop"
    returned = threading.Event()
    connection: MqttConnection

    def stop_here(message: Received) -> None:
        connection.stop()  # on the io thread: it only asks
        returned.set()

    connection = MqttConnection(
        broker.target,
        client_id=_name("handler-stop"),
        subscriptions=[Subscription(topic, stop_here)],
        persistent=False,
    )
    connection.start().wait_ready(SAFETY_NET_S)
    _send(broker.target, topic, b"stop")
    assert returned.wait(SAFETY_NET_S)
    connection.stop(timeout=SAFETY_NET_S)  # joins the thread that ended on its own
    assert connection.health()["alive"] is False


def test_the_embedded_broker_is_spoken_to_in_311(embedded_broker: EmbeddedBroker) -> None:
    target = MqttTarget.parse(embedded_broker.url)
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/echo"
    got: queue.Queue[Received] = queue.Queue()
    connection = MqttConnection(
        target,
        client_id=_name("embedded"),
        subscriptions=[Subscription(topic, got.put)],
        persistent=False,
        backoff_min_s=0.05,
    )
    connection.start()
    try:
        connection.wait_ready(SAFETY_NET_S)
        assert connection.protocol == "3.1.1"
        assert connection.deliver(topic, b"echo").wait(SAFETY_NET_S)
        assert got.get(timeout=SAFETY_NET_S).payload == b"echo"
    finally:
        connection.stop()


def test_paho_is_never_called_after_stop(broker: Any) -> None:
    """The io thread is paho's only caller, and it is gone once stop() returns."""
    client_id = _name("after")
    calls: list[str] = []
    original = mqtt.Client.loop_misc

    def counting(self: mqtt.Client) -> mqtt.MQTTErrorCode:
        if self._client_id == client_id.encode():  # this test's connection only
            calls.append(threading.current_thread().name)
        return original(self)

    connection = MqttConnection(broker.target, client_id=client_id, persistent=False)
    mqtt.Client.loop_misc = counting  # type: ignore[method-assign]
    try:
        connection.start().wait_ready(SAFETY_NET_S)
        connection.publish("edgeloop-test/after", b"before the stop")
        assert connection.flush(SAFETY_NET_S)
        connection.stop()
        seen = len(calls)
        connection.publish("edgeloop-test/after", b"after the stop")
        connection.stop()
        assert seen > 0 and len(calls) == seen
        assert set(calls) == {"mqtt-io"}
    finally:
        mqtt.Client.loop_misc = original  # type: ignore[method-assign]
