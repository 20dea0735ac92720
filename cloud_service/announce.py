"""Retained model announcements: the cloud's one seam to the broker for model delivery.

``Announcer.announce(topic, payload)`` publishes ``payload`` retained at QoS 1 and
returns once the broker has it (PUBACK), so an agent that is offline now finds the
announcement when it next subscribes. An empty payload clears a retained message
(how a per-agent override is withdrawn). ``MqttAnnouncer`` is the real one;
``MemoryAnnouncer`` keeps the retained state in a dict for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import paho.mqtt.client as mqtt

from shared.errors import TransportError
from shared.mqtt import MqttTarget, make_client, negotiate_protocol

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
    """A paho client connected on first use; ``announce`` waits for the broker's PUBACK."""

    def __init__(
        self, target: MqttTarget, *, client_id: str = "edgeloop-announcer", timeout_s: float = 10.0
    ) -> None:
        self.target = target
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._client: mqtt.Client | None = None
        self._lock = threading.Lock()  # paho's publish/wait from several request threads
        self._connected = threading.Event()

    def _ensure(self) -> mqtt.Client:
        if self._client is not None and self._connected.is_set():
            return self._client
        if self._client is not None:
            self.close()
        try:
            protocol = negotiate_protocol(self.target, timeout=self.timeout_s)
            client = make_client(
                self.target, client_id=f"{self.client_id}-{time.monotonic_ns()}", protocol=protocol
            )
            client.on_connect = lambda c, u, f, rc, p=None: self._connected.set()
            client.on_disconnect = lambda c, *a: self._connected.clear()
            client.connect(self.target.host, self.target.port, 30)
        except (OSError, mqtt.WebsocketConnectionError) as exc:
            raise TransportError(f"cannot reach the broker {self.target!r}: {exc}") from exc
        client.loop_start()
        if not self._connected.wait(self.timeout_s):
            client.loop_stop()
            raise TransportError(f"broker {self.target!r} did not accept the connection")
        self._client = client
        return client

    def announce(self, topic: str, payload: bytes) -> None:
        with self._lock:
            client = self._ensure()
            info = client.publish(topic, payload, qos=1, retain=True)
            try:
                info.wait_for_publish(self.timeout_s)
            except (RuntimeError, ValueError) as exc:
                raise TransportError(f"announcement on {topic} not published: {exc}") from exc
            if not info.is_published():
                raise TransportError(f"broker did not acknowledge the announcement on {topic}")
        log.info("announced %d bytes on %s", len(payload), topic)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.disconnect()
            finally:
                client.loop_stop()
        self._connected.clear()
