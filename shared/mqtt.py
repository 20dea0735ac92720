"""MQTT connection helpers shared by every EdgeLoop process.

- ``MqttTarget.parse`` turns ``mqtt://user:pass@host:port`` / ``mqtts://...`` into
  connection parameters.
- ``make_client`` builds a paho-mqtt 2 client that sets ``TCP_NODELAY`` on its
  socket. Without it a paho subscriber's small PUBACKs are held back by Nagle's
  algorithm and QoS 1 throughput collapses (see docs/architecture.md, "Delivery is
  end to end").
  An MQTT v5 client reads packets without properties cheaply
  (``shared.mqtt_properties``).
- ``negotiate_protocol`` asks the broker for MQTT v5 and falls back to 3.1.1 when
  the broker refuses it (amqtt, older brokers), on a probe connection of its own.
- ``Subscription``, ``Received``, ``Delivery`` and ``Backoff`` are what a process's
  long-lived connection, ``shared.mqtt_connection.MqttConnection``, takes and gives:
  a filter with its handler, one message, the fate of one publish, the wait between
  reconnects.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from shared import mqtt_properties
from shared.errors import ConfigError, TransportError

__all__ = [
    "Backoff",
    "Delivery",
    "MqttTarget",
    "ProtocolName",
    "Received",
    "Subscription",
    "Wakeup",
    "make_client",
    "negotiate_protocol",
]

ProtocolName = Literal["5", "3.1.1"]


@dataclass(frozen=True)
class MqttTarget:
    """Where and how to connect: parsed from an ``mqtt://`` or ``mqtts://`` URL."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None  # CA bundle for mqtts://; the system's CAs when None

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
    ) -> MqttTarget:
        """Parse a broker URL; explicit credentials win over ones in the URL."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts"):
            raise ConfigError(
                f"broker URL {redact_url(url)!r} has scheme {parts.scheme!r}: "
                "use mqtt://host:port or mqtts://host:port"
            )
        if not parts.hostname:
            raise ConfigError(f"broker URL {redact_url(url)!r} names no host")
        try:
            port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
        except ValueError as exc:
            raise ConfigError(f"broker URL {redact_url(url)!r} has an invalid port") from exc
        return cls(
            host=parts.hostname,
            port=port,
            tls=parts.scheme == "mqtts",
            username=username or (unquote(parts.username) if parts.username else None),
            password=password or (unquote(parts.password) if parts.password else None),
            ca_file=ca_file,
        )

    @property
    def anonymous(self) -> bool:
        return self.username is None

    def __repr__(self) -> str:  # never show the password
        scheme = "mqtts" if self.tls else "mqtt"
        user = f"{self.username}:***@" if self.username else ""
        return f"MqttTarget({scheme}://{user}{self.host}:{self.port})"


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
        # Never zero: a broker coming back should not see every client at once.
        return max(self.base / 2, self._rng.uniform(0, ceiling))

    def reset(self) -> None:
        self.attempt = 0


@dataclass(frozen=True, slots=True)
class Received:
    """One message from the broker, as a subscription's handler gets it."""

    topic: str
    payload: bytes
    qos: int
    mid: int  # the packet id :meth:`MqttConnection.ack` takes on a manual-ack connection


Handler = Callable[[Received], None]


@dataclass(frozen=True)
class Subscription:
    """A topic filter, its QoS and the handler of the messages it brings.

    With ``shared_group`` the filter is subscribed as ``$share/{group}/{filter}`` on
    MQTT v5 (the broker splits its messages among the group) and plainly on 3.1.1.
    """

    topic_filter: str
    handler: Handler
    qos: int = 1
    shared_group: str | None = None

    def resolved(self, protocol: ProtocolName) -> str:
        """The filter as subscribed over ``protocol``."""
        if self.shared_group is not None and protocol == "5":
            return f"$share/{self.shared_group}/{self.topic_filter}"
        return self.topic_filter


class Delivery:
    """What became of one publish handed over with :meth:`MqttConnection.deliver`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """True once the broker acknowledged it (QoS 1) or it was written (QoS 0)."""
        return self._done.wait(timeout) and self.error is None

    def confirm(self) -> None:
        self._done.set()

    def fail(self, error: str) -> None:
        if not self._done.is_set():
            self.error = error
            self._done.set()


class Wakeup:
    """Wakes a ``select`` on :attr:`reader` from other threads: one byte per wake-up."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        self._sent = False

    def signal(self) -> None:
        """Make :attr:`reader` readable (one byte until it is cleared; never blocks)."""
        if not self._sent:
            self._sent = True
            with contextlib.suppress(BlockingIOError, OSError):
                self._writer.send(b"\0")

    def clear(self) -> None:
        # Read the pipe before clearing the flag: a signal in between then either finds
        # the flag set and its work seen next, or sends a fresh byte.
        with contextlib.suppress(BlockingIOError, OSError):
            while self.reader.recv(4096):
                pass
        self._sent = False

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _set_nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    raw = getattr(sock, "_socket", sock)  # paho may wrap the socket for TLS/websockets
    # Not a TCP socket (unix socket, test double): nothing to tune.
    with contextlib.suppress(OSError, AttributeError):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def make_client(
    target: MqttTarget,
    *,
    client_id: str,
    protocol: ProtocolName = "5",
    clean_start: bool = True,
    ca_file: str | None = None,
    manual_ack: bool = False,
) -> mqtt.Client:
    """A paho client for ``target`` with TCP_NODELAY, credentials and TLS applied.

    ``clean_start`` applies to 3.1.1 here (clean session); for MQTT v5 pass
    ``clean_start`` and a session expiry to ``connect()``. ``manual_ack`` lets a
    receiver acknowledge a QoS 1 message only once it is durably stored.
    """
    version = MQTTProtocolVersion.MQTTv5 if protocol == "5" else MQTTProtocolVersion.MQTTv311
    if version == MQTTProtocolVersion.MQTTv5:
        mqtt_properties.install()  # paho's v5 properties, cheap to read (see that module)
    kwargs: dict[str, Any] = {
        "client_id": client_id,
        "protocol": version,
        "manual_ack": manual_ack,
    }
    if protocol != "5":
        kwargs["clean_session"] = clean_start
    client = mqtt.Client(CallbackAPIVersion.VERSION2, **kwargs)
    client.on_socket_open = _set_nodelay
    if target.username is not None:
        client.username_pw_set(target.username, target.password)
    if target.tls:
        context = ssl.create_default_context(cafile=ca_file or target.ca_file)
        client.tls_set_context(context)
    return client


def negotiate_protocol(target: MqttTarget, *, timeout: float = 5.0) -> ProtocolName:
    """Ask for MQTT v5; return "3.1.1" if the broker refuses v5 or drops the connection."""
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        outcome["failure"] = bool(getattr(reason, "is_failure", False))
        done.set()

    def on_disconnect(client: mqtt.Client, *args: Any) -> None:
        done.set()

    probe = make_client(target, client_id=f"edgeloop-probe-{threading.get_ident()}", protocol="5")
    probe.on_connect = on_connect
    probe.on_disconnect = on_disconnect
    try:
        probe.connect(target.host, target.port, keepalive=10)
    except OSError as exc:
        raise TransportError(
            f"cannot reach MQTT broker at {target.host}:{target.port}: {exc}"
        ) from exc
    probe.loop_start()
    try:
        done.wait(timeout)
    finally:
        probe.disconnect()
        probe.loop_stop()
    if outcome.get("failure") is False:
        return "5"
    return "3.1.1"
