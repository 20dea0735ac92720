"""The agent's MQTT link: one paho client, confined to one thread.

``MqttLink`` is the real ``Publisher``: persistent session (a stable client id,
MQTT v5 clean_start=False with a session expiry, or a 3.1.1 persistent session),
QoS 1, a retained last will on the status topic, TCP_NODELAY (shared.make_client),
and reconnects with exponential backoff and full jitter. Every paho call happens on
its ``mqtt-io`` thread; other threads hand messages over through ``publish``, which
only enqueues and wakes that thread. While disconnected the outbox is emptied:
samples come back from the spool (``on_connect`` makes them all due again),
heartbeats are re-sent anyway.

With ``protocol=None`` the link asks for MQTT v5 on its own connection and falls
back to 3.1.1 when the broker refuses v5 or drops the connection unanswered. It
never probes with a second connection: a broker that names each agent's session
after its user (``use_username_as_clientid``) would give that probe the agent's
session, and its clean start would discard what was queued for the agent.

The thread runs paho's external-loop API (``loop_read``, ``loop_write``,
``loop_misc``) on its own ``select``. A publish on an idle link wakes it at once
through the link's socket pair; while a publish awaits its PUBACK, that PUBACK
wakes the thread within a round trip and later publishes ride along (a wake-up for
each cost the agent ~6% more CPU per frame when it forwarded 14% of ~700 frames/s;
20 ms at most if the PUBACK is slow). paho's ``loop()`` polled instead: a sample
forwarded on an idle link waited for the select timeout (25 ms on average), and
paho wrote to its own wake-up socket for every packet it queued.

A broker's PUBACK is not delivery (see docs/architecture.md, "Delivery is end to end"):
nothing here deletes anything; the agent does that on the cloud's receipt.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from shared.errors import TransportError
from shared.mqtt import MqttTarget, ProtocolName, make_client

__all__ = ["Backoff", "MqttLink", "Publisher"]

log = logging.getLogger(__name__)
_UNSUPPORTED_VERSION = 0x84  # CONNACK: the broker does not speak the protocol version asked
# A broker that does not speak v5 may neither answer nor close (amqtt waits for more bytes).
_V5_ANSWER_TIMEOUT_S = 5.0

MessageHandler = Callable[[str, bytes], None]


class Publisher(Protocol):
    """The agent's seam to the network (MqttLink, or an in-memory double in tests)."""

    @property
    def connected(self) -> bool: ...

    @property
    def backlog(self) -> int: ...

    def set_handlers(
        self, *, on_message: MessageHandler, on_connect: Callable[[], None]
    ) -> None: ...

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False
    ) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Backoff:
    """Exponential backoff with full jitter: ``uniform(0, min(cap, base * 2**attempt))``."""

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        # Never zero: a broker coming back should not see every agent at once.
        return max(self.base / 2, self._rng.uniform(0, ceiling))

    def reset(self) -> None:
        self.attempt = 0


class MqttLink:
    """``link = MqttLink(target, client_id=..., subscriptions=[...], will=(topic, payload))``."""

    def __init__(
        self,
        target: MqttTarget,
        *,
        client_id: str,
        subscriptions: list[str],
        will: tuple[str, bytes] | None = None,
        protocol: ProtocolName | None = None,
        keepalive_s: int = 30,
        session_expiry_s: int = 7 * 86400,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 30.0,
        ca_file: str | None = None,
        max_outbox: int = 10_000,
    ) -> None:
        self.target = target
        self.client_id = client_id
        self.subscriptions = subscriptions
        self.will = will
        self.protocol = protocol  # None: found on the first connection that is answered
        self._trying: ProtocolName = protocol or "5"
        self._answered = False  # this connection got a CONNACK
        self.keepalive_s = keepalive_s
        self.session_expiry_s = session_expiry_s
        self.ca_file = ca_file
        self._backoff = Backoff(backoff_min_s, backoff_max_s)
        self._outbox: collections.deque[tuple[str, bytes, int, bool]] = collections.deque(
            maxlen=max_outbox
        )
        # publish() wakes the io thread's select through this pair, once per wake-up.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_sent = False
        self._awaiting_puback: set[int] = set()  # mids of QoS 1 publishes (io thread)
        self._stopping = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: mqtt.Client | None = None
        self._on_message: MessageHandler = lambda topic, payload: None
        self._on_connect: Callable[[], None] = lambda: None
        self.connects = 0
        self.disconnects = 0
        self.published = 0
        self.last_error: str | None = None

    # --- Publisher ---------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def backlog(self) -> int:
        return len(self._outbox)

    def status(self) -> dict[str, Any]:
        """The link as ``edge-agent status`` shows it."""
        return {
            "broker": f"{self.target.host}:{self.target.port}",
            "client_id": self.client_id,
            "connected": self.connected,
            "connects": self.connects,
            "disconnects": self.disconnects,
            "outbox": len(self._outbox),
            "last_error": self.last_error,
        }

    def set_handlers(self, *, on_message: MessageHandler, on_connect: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_connect = on_connect

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self._outbox.append((topic, payload, qos, retain))
        if not self._awaiting_puback:  # else its PUBACK wakes the io thread shortly
            self._signal()

    def _signal(self) -> None:
        """Wake the io thread's select (one byte until it has woken; never blocks)."""
        if not self._wake_sent:
            self._wake_sent = True
            with contextlib.suppress(BlockingIOError, OSError):
                self._wake_w.send(b"\0")

    def _clear_wake(self) -> None:
        # Read the pipe before clearing the flag: a publish in between then either
        # finds the flag set and its message drained next, or sends a fresh byte.
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        self._wake_sent = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mqtt-io", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (the will is not sent then; the agent publishes 'offline' first)."""
        self._stopping.set()
        self._signal()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is handed to the socket (for the final 'offline' status)."""
        deadline = time.monotonic() + timeout
        while self._outbox and self.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._outbox

    # --- the io thread -------------------------------------------------------------

    def _build(self, protocol: ProtocolName) -> mqtt.Client:
        client = make_client(
            self.target,
            client_id=self.client_id,
            protocol=protocol,
            clean_start=False,
            ca_file=self.ca_file,
        )
        client.max_inflight_messages_set(100)
        if self.will is not None:
            client.will_set(self.will[0], self.will[1], qos=1, retain=True)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.on_publish = self._handle_published
        return client

    def _connect(self) -> mqtt.Client:
        self._trying = self.protocol or self._trying
        client = self._client or self._build(self._trying)
        self._client = client
        self._answered = False
        if self._trying == "5":
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            client.connect(
                self.target.host,
                self.target.port,
                self.keepalive_s,
                clean_start=False,
                properties=props,
            )
        else:
            client.connect(self.target.host, self.target.port, self.keepalive_s)
        return client

    def _sleep(self, seconds: float) -> None:
        # Interruptible by stop(); publish() wake-ups are ignored while backing off.
        self._stopping.wait(seconds)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                client = self._connect()
            except (OSError, TransportError, mqtt.WebsocketConnectionError) as exc:
                self.last_error = str(exc)
                delay = self._backoff.next_delay()
                log.info("broker %r unreachable (%s); retrying in %.1fs", self.target, exc, delay)
                self._outbox.clear()
                self._sleep(delay)
                continue
            self._serve(client)
            if self.protocol is None and self._trying == "5" and not self._answered:
                self._fall_back("the broker closed the connection without answering MQTT v5")
            self._connected.clear()
            self._outbox.clear()
            if not self._stopping.is_set():
                delay = self._backoff.next_delay()
                log.info("connection to %r lost; reconnecting in %.1fs", self.target, delay)
                self._sleep(delay)
        last = self._client
        if last is not None:
            try:
                last.disconnect()  # written at once (no paho loop thread); closes the socket
                if last.want_write():
                    last.loop_write()
            except Exception:  # best effort on the way out
                log.debug("disconnect failed", exc_info=True)

    def _serve(self, client: mqtt.Client) -> None:
        """Run the socket until it drops or stop() is called (see the module docstring)."""
        answer_by = time.monotonic() + _V5_ANSWER_TIMEOUT_S
        while not self._stopping.is_set():
            if self.protocol is None and not self._answered and time.monotonic() > answer_by:
                self.last_error = "no answer to MQTT v5"
                self._abandon(client)
                return
            if self._connected.is_set():
                while self._outbox:
                    topic, payload, qos, retain = self._outbox.popleft()
                    # Written to the socket at once (paho with no loop thread of its own).
                    info = client.publish(topic, payload, qos=qos, retain=retain)
                    if qos and info.rc == mqtt.MQTT_ERR_SUCCESS:
                        self._awaiting_puback.add(info.mid)
                    if info.rc != mqtt.MQTT_ERR_SUCCESS and info.rc != mqtt.MQTT_ERR_NO_CONN:
                        log.warning("publish to %s failed: %s", topic, mqtt.error_string(info.rc))
                    self.published += 1
            sock = client.socket()
            if sock is None:
                self.last_error = "the connection closed"
                return
            if getattr(sock, "pending", lambda: 0)():  # TLS bytes already read and decrypted
                readable: list[Any] = [sock]
                writable: list[Any] = []
            else:
                wanted = [sock] if client.want_write() else []
                # Work wakes the select; the timeout paces keepalive pings (loop_misc)
                # and bounds the wait of a publish that counted on a PUBACK.
                timeout = 0.02 if self._outbox else 1.0
                readable, writable, _ = select.select([sock, self._wake_r], wanted, [], timeout)
            if self._wake_r in readable:
                self._clear_wake()
            rc = mqtt.MQTT_ERR_SUCCESS
            if sock in readable:
                rc = client.loop_read()
            if rc == mqtt.MQTT_ERR_SUCCESS and sock in writable:
                rc = client.loop_write()
            if rc == mqtt.MQTT_ERR_SUCCESS:
                rc = client.loop_misc()
            if rc != mqtt.MQTT_ERR_SUCCESS:
                self.last_error = mqtt.error_string(rc)
                return

    def _abandon(self, client: mqtt.Client) -> None:
        """Close a connection the broker never answered (the client is not used again)."""
        sock = client.socket()
        with contextlib.suppress(OSError, AttributeError):
            if sock is not None:
                sock.close()

    def _fall_back(self, why: str) -> None:
        """Use MQTT 3.1.1 from the next connection on (a fresh client of that version)."""
        log.info("%s: using MQTT 3.1.1", why)
        self.protocol = self._trying = "3.1.1"
        self._client = None

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
        for topic in self.subscriptions:
            client.subscribe(topic, qos=1)
        self.connects += 1
        self._backoff.reset()
        self._connected.set()
        log.info("connected to %r (MQTT %s)", self.target, self.protocol)
        try:
            self._on_connect()
        except Exception:
            log.exception("on_connect handler failed")

    def _handle_disconnect(self, client: mqtt.Client, *args: Any) -> None:
        if self._connected.is_set():
            self.disconnects += 1
        self._connected.clear()
        self._awaiting_puback.clear()  # the spool publishes them again on reconnect

    def _handle_published(self, client: mqtt.Client, userdata: Any, mid: int, *args: Any) -> None:
        # A PUBACK for QoS 1 (paho also reports a QoS 0 message once it is written).
        self._awaiting_puback.discard(mid)

    def _handle_message(
        self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage
    ) -> None:
        try:
            self._on_message(message.topic, bytes(message.payload))
        except Exception:  # a handler bug must not take the link down
            log.exception("message handler failed on %s", message.topic)
