"""The verifier's side of the broker: one MQTT connection, the bounded inbox, acks, publishes.

``VerifierTransport`` holds a ``shared.mqtt_connection.MqttConnection`` with the
verifier's persistent session (its client id, MQTT v5 session expiry and Receive
Maximum, or a 3.1.1 persistent session) and manual acks: a message is acknowledged
only once its batch is stored (``ack``). It subscribes to every agent's samples and
model statuses (an MQTT v5 shared subscription of ``verifier_group``, so several
verifiers split them) and to every agent's status (plain: retained statuses are not
sent to shared subscriptions).

Each message goes into :attr:`VerifierTransport.inbox`; :attr:`VerifierTransport.budget`
bounds, by count and bytes, everything held from there until a batch is stored. A
QoS 1 message waits for room on the connection's thread (it stops reading, TCP
pushes back on the broker, and unacked the message stays the broker's); a QoS 0 one
is dropped. A message over every limit is kept without its bytes, to be dead-lettered
as ``too_large``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from cloud_service.ingest import InboxBudget
from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from shared.envelope import PREFIX_SIZE
from shared.messages import DEFAULT_MAX_MESSAGE_BYTES
from shared.mqtt import ProtocolName, Received, Subscription, negotiate_protocol
from shared.mqtt_connection import MqttConnection
from shared.topics import validate_id

__all__ = ["Inbound", "VerifierTransport"]

# Broker-side window of unacknowledged messages to us (MQTT v5 Receive Maximum):
# with manual acks after each commit, the window must cover a whole ingest batch.
_RECEIVE_MAXIMUM = 2000


@dataclass(frozen=True, slots=True)
class Inbound:
    """One received message as the verifier holds it."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    size: int  # bytes as received; ``payload`` is empty when it was over every limit

    @property
    def held(self) -> int:
        return len(self.payload)


class VerifierTransport:
    """``start(timeout)``; messages arrive in ``inbox``; ``ack``, ``publish``, ``stop``."""

    def __init__(self, settings: CloudSettings, metrics: CloudMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        topics = settings.topics
        limits = settings.envelope_limits
        # No message the cloud takes is larger; a bigger one is dead-lettered unread.
        self.max_payload = max(
            PREFIX_SIZE + limits.max_header_bytes + limits.max_image_bytes,
            DEFAULT_MAX_MESSAGE_BYTES,
        )
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.budget = InboxBudget(
            max_messages=settings.inbox_max_messages, max_bytes=settings.inbox_max_bytes
        )
        metrics.inbox_messages.set_function(lambda: self.budget.messages)
        metrics.inbox_bytes.set_function(lambda: self.budget.bytes)
        self._muted = False
        group = validate_id(settings.verifier_group, "shared subscription group")
        self.subscriptions = (
            Subscription(topics.samples_filter(), self._on_message, shared_group=group),
            Subscription(topics.model_status_filter(), self._on_message, shared_group=group),
            # Plain, never shared: retained statuses are not sent to shared
            # subscriptions, and every verifier may upsert the same status.
            Subscription(topics.status_filter(), self._on_message),
        )
        self.connection = MqttConnection(
            settings.mqtt,
            client_id=settings.verifier_client_id,
            subscriptions=self.subscriptions,
            persistent=True,
            session_expiry_s=settings.mqtt_session_expiry_s,
            keepalive_s=30,
            ca_file=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None,
            manual_ack=True,
            receive_maximum=min(_RECEIVE_MAXIMUM, settings.inbox_max_messages),
            max_inflight=200,
            max_outbox=None,
            keep_while_offline=True,
            backoff_min_s=1.0,
            backoff_max_s=5.0,
            name="verifier-mqtt",
        )

    @property
    def protocol(self) -> ProtocolName:
        """The MQTT version spoken (v5 until a broker answered otherwise)."""
        return self.connection.protocol or "5"

    @property
    def ready(self) -> bool:
        return self.connection.ready

    def filters(self) -> list[str]:
        """The topic filters subscribed, as the broker sees them."""
        return [s.resolved(self.protocol) for s in self.subscriptions]

    def start(self, timeout: float) -> None:
        """Connect; TransportError unless every subscription is acknowledged in ``timeout`` s."""
        # The version from a probe of its own: a broker that does not speak v5 (amqtt)
        # leaves a v5 CONNECT carrying a session expiry unanswered, and the connection
        # would wait 5 s for that answer before it falls back. The verifier's service
        # listener does not name sessions after users, so the probe takes no session.
        self.connection.protocol = negotiate_protocol(self.settings.mqtt)
        self.connection.start()
        self.connection.wait_ready(timeout)

    def mute(self) -> None:
        """Take no more messages: what arrives from now on stays unacked (the broker
        delivers it again), and a wait for room in the inbox returns."""
        self._muted = True
        self.budget.close()

    def stop(self) -> None:
        """Disconnect; the session keeps the subscriptions and what queues meanwhile."""
        self.connection.stop()

    def ack(self, messages: list[Inbound]) -> None:
        """Tell the broker it may forget ``messages`` (stored durably by now)."""
        for message in messages:
            if message.qos > 0:
                self.connection.ack(message.mid, message.qos)

    def publish(self, topic: str, payload: bytes) -> None:
        """Publish at QoS 1; held while disconnected and sent on the next connection."""
        self.connection.publish(topic, payload, qos=1)

    def _on_message(self, message: Received) -> None:
        if self._muted:
            return
        payload = message.payload
        size = len(payload)
        if size > self.max_payload:
            payload = b""  # dead-lettered as too_large without keeping its bytes
        if message.qos == 0:
            # Nothing depends on a QoS 0 message arriving, and nothing would resend it:
            # with the inbox full it is dropped here rather than held.
            if not self.budget.try_acquire(len(payload)):
                if not self.budget.closed:  # not merely stopping
                    self.metrics.inbox_dropped.labels("qos0_inbox_full").inc()
                return
        elif not self.budget.try_acquire(len(payload)):
            self.metrics.inbox_waits.inc()
            # Wait on the connection's thread: it stops reading the socket, so TCP
            # pushes back on the broker and its own queue limits apply.
            if not self.budget.acquire(len(payload)):
                return  # stopping: left unacked, the broker delivers it again
        self.inbox.put(Inbound(message.topic, payload, message.qos, message.mid, size))
