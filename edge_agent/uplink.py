"""The agent's MQTT link: its seam to the network, on one shared MQTT connection.

``MqttLink`` is the real ``Publisher``: a ``shared.mqtt_connection.MqttConnection``
with a persistent session (a stable client id, MQTT v5 clean_start=False with a
session expiry, or a 3.1.1 persistent session), QoS 1, a retained last will on the
status topic, TCP_NODELAY, and reconnects with exponential backoff and full jitter.
Every paho call happens on the connection's ``mqtt-io`` thread; other threads hand
messages over through ``publish``, which only enqueues and wakes that thread. While
disconnected the outbox is emptied: samples come back from the spool (``on_connect``
makes them all due again), heartbeats are re-sent anyway.

With ``protocol=None`` the link asks for MQTT v5 on its own connection and falls
back to 3.1.1 when the broker refuses v5 or drops the connection unanswered; it
never probes with a second connection (see ``shared.mqtt_connection``).

A broker's PUBACK is not delivery (see docs/architecture.md, "Delivery is end to end"):
nothing here deletes anything; the agent does that on the cloud's receipt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from shared.mqtt import Backoff, MqttTarget, ProtocolName, Received, Subscription
from shared.mqtt_connection import MqttConnection

__all__ = ["Backoff", "MqttLink", "Publisher"]

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
        self.keepalive_s = keepalive_s
        self.session_expiry_s = session_expiry_s
        self.ca_file = ca_file
        self._on_message: MessageHandler = lambda topic, payload: None
        self._on_connect: Callable[[], None] = lambda: None
        self._connection = MqttConnection(
            target,
            client_id=client_id,
            subscriptions=[Subscription(topic, self._dispatch) for topic in subscriptions],
            on_connect=lambda: self._on_connect(),
            protocol=protocol,
            persistent=True,
            session_expiry_s=session_expiry_s,
            keepalive_s=keepalive_s,
            will=will,
            ca_file=ca_file,
            max_inflight=100,
            max_outbox=max_outbox,
            backoff_min_s=backoff_min_s,
            backoff_max_s=backoff_max_s,
            name="mqtt",
        )

    # --- what the agent and `edge-agent status` read -------------------------------

    @property
    def protocol(self) -> ProtocolName | None:
        """The MQTT version spoken; None until a broker answered (with ``protocol=None``)."""
        return self._connection.protocol

    @property
    def connects(self) -> int:
        return self._connection.connects

    @property
    def disconnects(self) -> int:
        return self._connection.disconnects

    @property
    def published(self) -> int:
        return self._connection.published

    @property
    def last_error(self) -> str | None:
        return self._connection.last_error

    @property
    def connected(self) -> bool:
        return self._connection.connected

    @property
    def backlog(self) -> int:
        return self._connection.backlog

    def status(self) -> dict[str, Any]:
        """The link as ``edge-agent status`` shows it."""
        return {
            "broker": f"{self.target.host}:{self.target.port}",
            "client_id": self.client_id,
            "connected": self.connected,
            "connects": self.connects,
            "disconnects": self.disconnects,
            "outbox": self.backlog,
            "last_error": self.last_error,
        }

    def health(self) -> dict[str, object]:
        return self._connection.health()

    # --- Publisher -------------------------------------------------------------------

    def set_handlers(self, *, on_message: MessageHandler, on_connect: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_connect = on_connect

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self._connection.publish(topic, payload, qos=qos, retain=retain)

    def start(self) -> None:
        self._connection.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (the will is not sent then; the agent publishes 'offline' first)."""
        self._connection.stop(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Return once connected with every subscription acknowledged; TransportError if
        not within ``timeout`` s, or at once when the broker cannot be reached."""
        self._connection.wait_ready(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is handed to the socket (for the final 'offline' status)."""
        return self._connection.flush(timeout)

    def _dispatch(self, message: Received) -> None:
        self._on_message(message.topic, message.payload)
