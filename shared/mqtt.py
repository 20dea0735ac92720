"""MQTT connection helpers shared by every EdgeLoop process.

- ``MqttTarget.parse`` turns ``mqtt://user:pass@host:port`` / ``mqtts://...`` into
  connection parameters.
- ``make_client`` builds a paho-mqtt 2 client that sets ``TCP_NODELAY`` on its
  socket. Without it a paho subscriber's small PUBACKs are held back by Nagle's
  algorithm and QoS 1 throughput collapses (see docs/architecture.md, "Delivery is
  end to end").
- ``negotiate_protocol`` asks the broker for MQTT v5 and falls back to 3.1.1 when
  the broker refuses it (amqtt, older brokers).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from shared.errors import ConfigError, TransportError

__all__ = ["MqttTarget", "ProtocolName", "make_client", "negotiate_protocol"]

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
