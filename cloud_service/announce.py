"""Retained model announcements: the cloud's one seam to the broker for model delivery.

``Announcer.announce(topic, payload)`` publishes ``payload`` retained at QoS 1 and
returns once the broker has it (PUBACK), so an agent that is offline now finds the
announcement when it next subscribes. An empty payload clears a retained message
(how a per-agent override is withdrawn). ``MqttAnnouncer`` is the real one;
``MemoryAnnouncer`` keeps the retained state in a dict for tests.
The broker's MQTT version is found on the connection itself (v5, else 3.1.1).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from shared.errors import TransportError
from shared.mqtt import MqttTarget
from shared.mqtt_connection import MqttConnection

__all__ = ["Announcer", "MemoryAnnouncer", "MqttAnnouncer"]

log = logging.getLogger(__name__)


class Announcer(Protocol):
    def announce(self, topic: str, payload: bytes) -> None:
        """Publish ``payload`` retained (QoS 1); ``b""`` clears the retained message."""
        ...

    def close(self) -> None: ...


class MemoryAnnouncer:
    """Retained messages in a dict (``retained[topic]``), and every publish in order."""

    def __init__(self) -> None:
        self.retained: dict[str, bytes] = {}
        self.published: list[tuple[str, bytes]] = []

    def announce(self, topic: str, payload: bytes) -> None:
        self.published.append((topic, payload))
        if payload:
            self.retained[topic] = payload
        else:
            self.retained.pop(topic, None)

    def close(self) -> None:
        pass


class MqttAnnouncer:
    """An MQTT connection opened on first use; ``announce`` waits for the broker's PUBACK."""

    def __init__(
        self, target: MqttTarget, *, client_id: str = "edgeloop-announcer", timeout_s: float = 10.0
    ) -> None:
        self.target = target
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._connection: MqttConnection | None = None
        self._lock = threading.Lock()  # announce() and close() from several request threads

    def _ensure(self) -> MqttConnection:
        """The connection, opened anew (with a fresh client id) when it is not connected."""
        if self._connection is not None and self._connection.connected:
            return self._connection
        self._close()
        connection = MqttConnection(
            self.target,
            client_id=f"{self.client_id}-{time.monotonic_ns()}",
            persistent=False,
            keepalive_s=30,
            max_outbox=None,
            keep_while_offline=True,
            backoff_min_s=1.0,
            backoff_max_s=5.0,
            name="announcer-mqtt",
        ).start()
        try:
            connection.wait_ready(self.timeout_s)
        except TransportError:
            connection.stop()
            raise
        self._connection = connection
        return connection

    def announce(self, topic: str, payload: bytes) -> None:
        with self._lock:
            delivery = self._ensure().deliver(topic, payload, qos=1, retain=True)
            if not delivery.wait(self.timeout_s):
                why = delivery.error or "no PUBACK in time"
                raise TransportError(
                    f"broker did not acknowledge the announcement on {topic}: {why}"
                )
        log.info("announced %d bytes on %s", len(payload), topic)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.stop()
