"""One MQTT connection for every EdgeLoop process: connect, reconnect, subscribe, publish, stop.

:class:`MqttConnection` is how the agent's uplink, the verifier's transport and the
model announcer talk to the broker. One thread, ``{name}-io`` (a ``Workers``
worker), owns the paho client and alone calls into it. It connects (``make_client``:
TLS, TCP_NODELAY), waits out ``Backoff`` between attempts, subscribes every
``Subscription`` again on each connection and hands each message to its handler.
Other threads hand over publishes and manual acks, which only enqueue and wake it.
With ``protocol=None`` it asks for MQTT v5 on its own connection and falls back to
3.1.1 when the broker refuses v5 or drops the connection unanswered; it never probes
with a second connection (a broker that names sessions after users would give the
probe the caller's session, and its clean start would discard what was queued).

The io thread runs paho's external-loop API (``loop_read``, ``loop_write``,
``loop_misc``) on its own ``select``. A publish on an idle connection wakes it through
a socket pair and is written in that pass; while a publish awaits its PUBACK, later
ones ride along with it (20 ms at most: the select's timeout then).

``stop`` is idempotent and safe from any thread, during a reconnect too: it sets the
stop event, wakes the io thread and joins it. On its way out the io thread writes what
was handed over, then disconnects; nothing calls into paho after that. A PUBACK is
not delivery (docs/architecture.md, "Delivery is end to end").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.errors import TransportError
from shared.lifecycle import Workers
from shared.mqtt import (
    Backoff,
    Delivery,
    Handler,
    MqttTarget,
    ProtocolName,
    Received,
    Subscription,
    Wakeup,
    make_client,
)
from shared.mqtt_socket import BufferedSocket, buffered
from shared.topics import topic_matches

__all__ = ["MqttConnection"]

log = logging.getLogger(__name__)
_READS_PER_PASS = 64  # packets one pass reads at most: writes and pings wait no longer

_UNSUPPORTED_VERSION = 0x84  # CONNACK: the broker does not speak the protocol version asked
# A broker that does not speak v5 may neither answer nor close (amqtt waits for more bytes).
_V5_ANSWER_TIMEOUT_S = 5.0
_HANDLER_CACHE = 4096  # topics whose handler is remembered
_FLUSH_ON_STOP_S = 2.0  # at most this long writing what was handed over, on stop


# (topic, payload, qos, retain, delivery)
_Outgoing = tuple[str, bytes, int, bool, Delivery | None]


class MqttConnection:
    """``MqttConnection(target, client_id=..., subscriptions=[...]).start()``; ``stop()``.

    ``on_connect`` runs on the io thread after each CONNACK (subscriptions sent),
    ``on_disconnect`` after each connection ends, before the backoff.

    ``persistent``: clean_start off and a v5 session expiry of ``session_expiry_s`` (a
    3.1.1 persistent session), so the broker queues QoS 1 messages while away.
    ``keep_while_offline``: publishes handed over while disconnected wait for the next
    connection; otherwise they are dropped (the agent's spool sends samples again).
    ``manual_ack``: QoS 1 messages are acknowledged only through :meth:`ack`.
    """

    def __init__(
        self,
        target: MqttTarget,
        *,
        client_id: str,
        subscriptions: Sequence[Subscription] = (),
        on_connect: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        protocol: ProtocolName | None = None,
        persistent: bool = True,
        session_expiry_s: int = 7 * 86400,
        keepalive_s: int = 30,
        will: tuple[str, bytes] | None = None,
        ca_file: str | None = None,
        manual_ack: bool = False,
        receive_maximum: int | None = None,
        max_inflight: int | None = None,
        max_outbox: int | None = 10_000,
        keep_while_offline: bool = False,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 30.0,
        name: str = "mqtt",
    ) -> None:
        self.target = target
        self.client_id = client_id
        self.subscriptions = tuple(subscriptions)
        # None: found on the first connection that is answered (or set before start)
        self.protocol = protocol
        self.persistent = persistent
        self.session_expiry_s = session_expiry_s
        self.keepalive_s = keepalive_s
        self.will = will
        self.ca_file = ca_file
        self.manual_ack = manual_ack
        self.receive_maximum = receive_maximum
        self.max_inflight = max_inflight
        self.keep_while_offline = keep_while_offline
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._trying: ProtocolName = protocol or "5"
        self._answered = False  # this connection got a CONNACK
        self._backoff = Backoff(backoff_min_s, backoff_max_s)
        self._outbox: collections.deque[_Outgoing] = collections.deque(maxlen=max_outbox)
        self._acks: collections.deque[tuple[int, int]] = collections.deque()
        self._awaiting_puback: set[int] = set()  # mids of QoS 1 publishes (io thread)
        self._deliveries: dict[int, Delivery] = {}  # mid -> its Delivery (io thread)
        handlers = {s.handler for s in self.subscriptions}
        self._only_handler = handlers.pop() if len(handlers) == 1 else None
        self._handlers: dict[str, Handler | None] = {}  # topic -> handler (io thread)
        self._wake = Wakeup()  # publish() wakes the io thread's select through it
        self._workers = Workers(name)
        self._stopping = self._workers.stopping
        self._lifecycle = threading.Lock()  # start() and stop()
        self._thread: threading.Thread | None = None
        self._joined = False
        self._state = threading.Condition()  # connected, subscribed, failures, flushes
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self._unreachable: str | None = None  # the last attempt's error, until a CONNACK
        self._flush_waiters = 0
        self._client: mqtt.Client | None = None
        self.connects = 0
        self.disconnects = 0
        self.published = 0
        self.last_error: str | None = None

    # --- state -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def ready(self) -> bool:
        """Connected, with every subscription acknowledged by the broker."""
        return self._connected.is_set() and self._subscribed.is_set()

    @property
    def backlog(self) -> int:
        """Publishes handed over and not yet written to paho."""
        return len(self._outbox)

    def health(self) -> dict[str, object]:
        shown = ("connected", "ready", "protocol", "connects", "disconnects", "published")
        alive = self._thread is not None and self._thread.is_alive()
        return {
            "alive": alive,
            **{key: getattr(self, key) for key in shown},
            "backlog": self.backlog,
            "last_error": self.last_error,
        }

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> MqttConnection:
        """Start the io thread (once; a stopped connection is not started again)."""
        with self._lifecycle:
            if self._thread is None and not self._stopping.is_set():
                self._thread = self._workers.spawn("io", self._run)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Return once :attr:`ready`; TransportError after ``timeout`` seconds, or at once
        when an attempt finds the broker unreachable (refused, unresolvable, bad TLS)."""
        deadline = time.monotonic() + timeout
        with self._state:
            while not self.ready:
                if self._unreachable is not None:
                    raise TransportError(
                        f"cannot reach the MQTT broker at {self.target.host}:{self.target.port}:"
                        f" {self._unreachable}"
                    )
                if self._stopping.is_set():
                    raise TransportError(f"the connection to {self.target!r} is stopped")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = f" ({self.last_error})" if self.last_error else ""
                    raise TransportError(
                        f"no subscription acknowledged by the broker {self.target!r}"
                        f" within {timeout} s{why}"
                    )
                self._state.wait(remaining)

    def stop(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (no will is sent) and join the io thread; idempotent.

        From a handler (the io thread itself) it only asks: the thread ends after it.
        """
        self._stopping.set()
        self._wake.signal()
        if threading.current_thread() is self._thread:
            return
        with self._lifecycle:
            if self._joined:
                return
            if self._thread is None:  # never started: nothing else holds the sockets
                self._wake.close()
                self._joined = True
                return
            self._joined = not self._workers.stop(timeout)

    # --- handing over ----------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Queue a publish for the io thread (dropped once stopping)."""
        if self._stopping.is_set():
            return
        self._outbox.append((topic, payload, qos, retain, None))
        if not self._awaiting_puback:  # else its PUBACK wakes the io thread shortly
            self._wake.signal()

    def deliver(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False
    ) -> Delivery:
        """Queue a publish and return its :class:`Delivery` to wait on."""
        delivery = Delivery()
        if self._stopping.is_set():
            delivery.fail("the connection is stopped")
            return delivery
        self._outbox.append((topic, payload, qos, retain, delivery))
        self._wake.signal()
        return delivery

    def ack(self, mid: int, qos: int) -> None:
        """Acknowledge a received QoS 1 message (``manual_ack``); dropped if the
        connection it came on is gone (the broker sends the message again)."""
        if not self._stopping.is_set():
            self._acks.append((mid, qos))
            self._wake.signal()

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is handed to the socket; False if it is not by then."""
        deadline = time.monotonic() + timeout
        with self._state:
            self._flush_waiters += 1
            try:
                while self._outbox and self._connected.is_set() and not self._stopping.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._state.wait(remaining)
            finally:
                self._flush_waiters -= 1
            return not self._outbox

    # --- the io thread -------------------------------------------------------------

    def _build(self, protocol: ProtocolName) -> mqtt.Client:
        client = make_client(
            self.target,
            client_id=self.client_id,
            protocol=protocol,
            clean_start=not self.persistent,
            ca_file=self.ca_file,
            manual_ack=self.manual_ack,
        )
        if self.max_inflight is not None:
            client.max_inflight_messages_set(self.max_inflight)
        if self.will is not None:
            client.will_set(self.will[0], self.will[1], qos=1, retain=True)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_subscribe = self._handle_subscribe
        client.on_message = self._handle_message
        client.on_publish = self._handle_published
        return client

    def _connect(self) -> mqtt.Client:
        self._trying = self.protocol or self._trying
        client = self._client or self._build(self._trying)
        self._client = client
        self._answered = False
        host, port = self.target.host, self.target.port
        if self._trying != "5":
            client.connect(host, port, self.keepalive_s)
            return buffered(client)
        props = Properties(PacketTypes.CONNECT)
        kwargs: dict[str, Any] = {}
        if self.persistent:
            props.SessionExpiryInterval = self.session_expiry_s
            kwargs["clean_start"] = False
        if self.receive_maximum is not None:
            props.ReceiveMaximum = self.receive_maximum
        if kwargs or self.receive_maximum is not None:
            kwargs["properties"] = props
        client.connect(host, port, self.keepalive_s, **kwargs)
        return buffered(client)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    client = self._connect()
                except (OSError, TransportError, mqtt.WebsocketConnectionError) as exc:
                    self._attempt_failed(str(exc))
                    delay = self._backoff.next_delay()
                    log.info(
                        "broker %r unreachable (%s); retrying in %.1fs", self.target, exc, delay
                    )
                    # Interruptible by stop(); publish() wake-ups are ignored while backing off.
                    self._stopping.wait(delay)
                    continue
                try:
                    self._serve(client)
                except Exception as exc:  # a paho or handler surprise must not end the thread
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("MQTT connection to %r failed", self.target)
                    self._abandon(client)
                if self._stopping.is_set():
                    break  # _shut writes what was handed over, then disconnects
                if self.protocol is None and self._trying == "5" and not self._answered:
                    self._fall_back("the broker closed the connection without answering MQTT v5")
                self._lost()
                delay = self._backoff.next_delay()
                log.info("connection to %r lost; reconnecting in %.1fs", self.target, delay)
                self._stopping.wait(delay)
        finally:
            self._shut()

    def _serve(self, client: mqtt.Client) -> None:
        """Run the socket until it drops or stop() is called (see the module docstring)."""
        answer_by = time.monotonic() + _V5_ANSWER_TIMEOUT_S
        while not self._stopping.is_set():
            if self.protocol is None and not self._answered and time.monotonic() > answer_by:
                self.last_error = "no answer to MQTT v5"
                self._abandon(client)
                return
            sock = client.socket()
            if not isinstance(sock, BufferedSocket):
                self.last_error = "the connection closed"
                return
            with sock.held():  # the acks, publishes and PUBACKs of one pass: one write
                rc = self._pass(client, sock)
            if self._flush_waiters:
                with self._state:
                    self._state.notify_all()
            if rc != mqtt.MQTT_ERR_SUCCESS:
                self.last_error = mqtt.error_string(rc)
                return

    def _pass(self, client: mqtt.Client, sock: BufferedSocket) -> mqtt.MQTTErrorCode:
        """One pass of the io loop: wait for the socket or a wake-up (not while read bytes
        are pending), hand over what is queued (written when ``held`` ends: a publish costs
        the pass of its wake-up and of its PUBACK), write, read all a read brought, ping."""
        connected = self._connected.is_set()
        if connected and (self._outbox or self._acks):  # queued while a PUBACK was due
            self._write_queued(client)
        sock.flush()  # what the kernel does not take now waits for the socket to be writable
        readable: list[Any] = [sock]  # when read already: a chunk's next packets, TLS records
        writable: list[Any] = []
        if not sock.pending():
            wanted: list[Any] = [sock] if client.want_write() or sock.unsent else []
            # Work wakes the select; the timeout paces keepalive pings (loop_misc)
            # and bounds the wait of a publish that counted on a PUBACK.
            watched: list[Any] = [sock, self._wake.reader]
            readable, writable, _ = select.select(watched, wanted, [], 0.02 if self._outbox else 1)
        if self._wake.reader in readable:
            self._wake.clear()
            if connected:
                self._write_queued(client)
        rc = mqtt.MQTT_ERR_SUCCESS
        if sock in writable:  # before reading: a handler may wait (the verifier's inbox)
            sock.flush()
            rc = client.loop_write()
        if rc == mqtt.MQTT_ERR_SUCCESS and sock in readable:
            for _ in range(_READS_PER_PASS):  # what the read brought, a bounded number
                rc = client.loop_read()
                if rc != mqtt.MQTT_ERR_SUCCESS or not sock.pending():
                    break
        if rc == mqtt.MQTT_ERR_SUCCESS:
            rc = client.loop_misc()
        return rc

    def _write_queued(self, client: mqtt.Client) -> None:
        """Hand the queued acks and publishes to paho (written at once: no paho thread)."""
        acks = self._acks
        while acks:
            mid, qos = acks.popleft()
            client.ack(mid, qos)
        outbox = self._outbox
        while outbox:
            topic, payload, qos, retain, delivery = outbox.popleft()
            try:
                info = client.publish(topic, payload, qos=qos, retain=retain)
            except (ValueError, TypeError) as exc:  # a topic or payload paho refuses
                log.warning("publish to %s refused: %s", topic, exc)
                if delivery is not None:
                    delivery.fail(str(exc))
                continue
            self.published += 1
            rc = info.rc
            if rc == mqtt.MQTT_ERR_SUCCESS and qos:
                self._awaiting_puback.add(info.mid)
            elif rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                log.warning("publish to %s failed: %s", topic, mqtt.error_string(rc))
            if delivery is None:
                continue
            if qos and rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                # paho holds it (and sends it again after a reconnect) until its PUBACK
                self._deliveries[info.mid] = delivery
            elif rc == mqtt.MQTT_ERR_SUCCESS:
                delivery.confirm()
            else:
                delivery.fail(mqtt.error_string(rc))

    def _attempt_failed(self, error: str) -> None:
        self.last_error = error
        with self._state:
            self._unreachable = error
            self._drop_offline()
            self._state.notify_all()

    def _lost(self) -> None:
        """After a connection ends: not connected, and what was for it dropped."""
        with self._state:
            self._connected.clear()
            self._subscribed.clear()
            self._awaiting_puback.clear()
            self._drop_offline()
            self._state.notify_all()
        _call(self._on_disconnect)

    def _drop_offline(self) -> None:
        """Under ``_state``: acks belong to the connection that is gone; publishes too
        unless ``keep_while_offline``."""
        self._acks.clear()
        if not self.keep_while_offline:
            self._fail_outbox("not connected")

    def _fail_deliveries(self, error: str) -> None:
        for delivery in self._deliveries.values():
            delivery.fail(error)
        self._deliveries.clear()

    def _fail_outbox(self, error: str) -> None:
        while self._outbox:
            delivery = self._outbox.popleft()[4]
            if delivery is not None:
                delivery.fail(error)

    def _shut(self) -> None:
        """The io thread's last act: write what was handed over, disconnect, settle every
        delivery, close the wake pair."""
        client = self._client
        if client is not None:
            try:
                if self._connected.is_set():
                    self._write_queued(client)  # the last receipts, acks, 'offline'
                client.disconnect()  # queued after them; paho closes the socket once written
                deadline = time.monotonic() + _FLUSH_ON_STOP_S
                while isinstance(sock := client.socket(), BufferedSocket) and (
                    client.want_write() or sock.unsent
                ):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not select.select([], [sock], [], remaining)[1]:
                        break
                    sock.flush()
                    if client.loop_write() != mqtt.MQTT_ERR_SUCCESS:
                        break
            except Exception:  # best effort on the way out
                log.debug("disconnect failed", exc_info=True)
            self._abandon(client)
        with self._state:
            self._connected.clear()
            self._subscribed.clear()
            self._acks.clear()
            self._fail_outbox("the connection stopped")
            self._fail_deliveries("the connection stopped")
            self._state.notify_all()
        self._wake.close()

    def _abandon(self, client: mqtt.Client) -> None:
        """Close a socket paho still holds (the client is not read again)."""
        sock = client.socket()
        with contextlib.suppress(OSError, AttributeError):
            if sock is not None:
                sock.close()

    def _fall_back(self, why: str) -> None:
        """Use MQTT 3.1.1 from the next connection on (a fresh client of that version)."""
        log.info("%s: using MQTT 3.1.1", why)
        self.protocol = self._trying = "3.1.1"
        self._client = None
        self._fail_deliveries("the broker does not speak MQTT v5")

    # --- paho callbacks (io thread) ---------------------------------------------------

    def _handle_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        self._answered = True
        if getattr(reason, "is_failure", False):
            if self.protocol is None and getattr(reason, "value", None) == _UNSUPPORTED_VERSION:
                self._fall_back("the broker does not speak MQTT v5")
                return
            self.last_error = f"broker refused the connection: {reason}"
            log.warning("%s", self.last_error)
            return
        self.protocol = self._trying
        filters = [(s.resolved(self.protocol), s.qos) for s in self.subscriptions]
        if filters:
            client.subscribe(filters)
        self.connects += 1
        self._backoff.reset()
        with self._state:
            self._unreachable = None
            self._connected.set()
            if not filters:
                self._subscribed.set()
            self._state.notify_all()
        log.info(
            "connected to %r (MQTT %s, session present: %s)",
            self.target,
            self.protocol,
            getattr(flags, "session_present", None),
        )
        _call(self._on_connect)

    def _handle_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any
    ) -> None:
        failures = [c for c in codes if getattr(c, "is_failure", False)]
        if failures:
            self.last_error = f"broker refused subscriptions: {failures}"
            log.error("%s", self.last_error)
            return
        with self._state:
            self._subscribed.set()
            self._state.notify_all()

    def _handle_disconnect(self, client: mqtt.Client, *args: Any) -> None:
        if self._connected.is_set():
            self.disconnects += 1
        self._connected.clear()
        self._awaiting_puback.clear()  # paho sends them again after a reconnect

    def _handle_published(self, client: mqtt.Client, userdata: Any, mid: int, *args: Any) -> None:
        # A PUBACK for QoS 1 (paho also reports a QoS 0 message once it is written).
        self._awaiting_puback.discard(mid)
        delivery = self._deliveries.pop(mid, None)
        if delivery is not None:
            delivery.confirm()

    def _handle_message(
        self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage
    ) -> None:
        topic = message.topic
        handler = self._only_handler or self._handler_for(topic)
        if handler is None:
            log.debug("no subscription takes a message on %s", topic)
            return
        try:
            handler(Received(topic, bytes(message.payload), message.qos, message.mid))
        except Exception:  # a handler bug must not take the connection down
            log.exception("message handler failed on %s", topic)

    def _handler_for(self, topic: str) -> Handler | None:
        """The handler of the first subscription whose filter matches ``topic``."""
        if topic in self._handlers:
            return self._handlers[topic]
        handler = next(
            (s.handler for s in self.subscriptions if topic_matches(s.topic_filter, topic)), None
        )
        if len(self._handlers) >= _HANDLER_CACHE:
            self._handlers.clear()
        self._handlers[topic] = handler
        return handler


def _call(hook: Callable[[], None] | None) -> None:
    """Run an owner's hook on the io thread; its failure is logged, never raised."""
    if hook is not None:
        try:
            hook()
        except Exception:
            log.exception("MQTT connection hook %r failed", hook)
