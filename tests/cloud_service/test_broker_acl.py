"""Broker security on a real Mosquitto started from `cloud-service broker-config` output.

Agent A may not publish under B's id nor read B's verdicts; anonymous clients and
wrong passwords are refused; TLS with the development CA works and plaintext to the
TLS port does not; enrollment with ``broker_auth`` issues working credentials that
the broker picks up on SIGHUP without a restart.
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_service.api import create_app
from cloud_service.brokerconf import (
    BrokerFiles,
    add_agent,
    check_password,
    hash_password,
    write_broker_config,
)
from shared.broker import free_port
from shared.topics import Topics
from tests.cloud_service.conftest import wait_until

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette wants httpx2; the httpx we have works
    from fastapi.testclient import TestClient

pytestmark = [pytest.mark.mqtt]

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
TOPICS = Topics(prefix="edgeloop/v1")


class SecureBroker:
    """A Mosquitto running the generated configuration on free ports."""

    def __init__(self, folder: Path, **limits: Any) -> None:
        if not Path(MOSQUITTO).exists():
            pytest.skip("mosquitto is not installed")
        self.folder = folder
        self.tls_port = free_port()  # agents
        self.service_port = free_port()  # services, TLS
        self.plain_port = free_port()  # services, loopback plaintext
        self.passwords = {"edgeloop-verifier": "verifier-pw", "edgeloop-api": "api-pw"}
        self.files = write_broker_config(
            folder,
            topics=TOPICS,
            tls_port=self.tls_port,
            host="127.0.0.1",
            service_port=self.service_port,
            plain_port=self.plain_port,
            dev_ca=True,
            service_passwords=self.passwords,
            **limits,
        )
        self.ca_file = folder / "ca.crt"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.folder / "mosquitto.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30  # a safety net
        ports = (self.tls_port, self.service_port, self.plain_port)
        while not (self.folder / "mosquitto.pid").exists() or not all(map(_answers, ports)):
            if time.monotonic() > deadline or self.process.poll() is not None:
                log = (self.folder / "mosquitto.log").read_text(errors="replace")
                raise RuntimeError(f"mosquitto did not start: {log[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(5)


def _answers(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture
def secure_broker(tmp_path: Path) -> Iterator[SecureBroker]:
    broker = SecureBroker(tmp_path / "broker")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


class Client:
    """A paho client that records what it receives and how its connection went."""

    def __init__(
        self,
        port: int,
        username: str | None,
        password: str | None,
        *,
        ca_file: Path | None = None,
        timeout: float = 30.0,
        client_id: str | None = None,
        session_expiry_s: int = 0,
    ) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.disconnects: list[Any] = []  # reason codes, in order
        self.puback: dict[int, Any] = {}  # mid -> the broker's PUBACK reason code
        self.connected = threading.Event()
        self.answered = threading.Event()
        self.suback: list[Any] = []
        self.subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"acl-test-{username}-{time.monotonic_ns()}",
            protocol=MQTTProtocolVersion.MQTTv5,
        )
        if username is not None:
            self.client.username_pw_set(username, password)
        if ca_file is not None:
            self.client.tls_set_context(ssl.create_default_context(cafile=str(ca_file)))
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.received.append((m.topic, bytes(m.payload)))
        self.client.on_subscribe = self._on_subscribe
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.reconnect_delay_set(60, 60)  # one try only within a test
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = session_expiry_s
        try:
            self.client.connect(
                "127.0.0.1",
                port,
                keepalive=10,
                clean_start=session_expiry_s == 0,
                properties=props,
            )
        except (OSError, ssl.SSLError):
            self.answered.set()
            return
        self.client.loop_start()
        self.answered.wait(timeout)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if not reason.is_failure:
            self.connected.set()
        self.answered.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, *a: Any) -> None:
        self.disconnects.append(reason)
        self.answered.set()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        self.puback[mid] = reason

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self.suback = list(codes)
        self.subscribed.set()

    def subscribe(self, topic: str) -> None:
        self.subscribed.clear()
        self.client.subscribe(topic, qos=1)
        assert self.subscribed.wait(5)

    def publish(self, topic: str, payload: bytes) -> Any:
        """Publish at QoS 1 and wait for the PUBACK; its reason code (None if none came)."""
        info = self.client.publish(topic, payload, qos=1)
        with contextlib.suppress(RuntimeError, ValueError):  # the connection went away
            info.wait_for_publish(5)
        return self.puback.get(info.mid)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _wait(predicate: Any, timeout: float = 30.0) -> bool:
    """Poll ``predicate``; ``timeout`` is a safety net, not a bound the test checks."""
    return wait_until(predicate, timeout, step=0.02)


def _once_reloaded(make: Callable[[], Client]) -> Client:
    """The first of ``make()``'s clients that the broker lets in.

    ``add_agent`` signals Mosquitto (SIGHUP), which reloads its password and ACL files
    in its own time: until then new credentials are refused, so try again.
    """
    pause = threading.Event()
    for _ in range(300):  # a safety net of about 30 s
        client = make()
        if client.connected.is_set():
            return client
        client.close()
        pause.wait(0.1)
    raise AssertionError("the broker never accepted the new credentials")


def test_password_hash_matches_mosquitto_passwd(tmp_path: Path) -> None:
    assert check_password("s3cret", hash_password("s3cret"))
    assert not check_password("other", hash_password("s3cret"))
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd is not installed")
    path = tmp_path / "pw"
    subprocess.run([tool, "-b", "-c", str(path), "alice", "s3cret"], check=True)
    theirs = path.read_text().strip().split(":", 1)[1]
    assert theirs.startswith("$7$") and check_password("s3cret", theirs)


def test_anonymous_and_wrong_password_are_refused(secure_broker: SecureBroker) -> None:
    anonymous = Client(secure_broker.plain_port, None, None)
    wrong = Client(secure_broker.plain_port, "edgeloop-verifier", "not-the-password")
    unknown = Client(secure_broker.plain_port, "fleet-a.nobody", "whatever")
    right = Client(secure_broker.plain_port, "edgeloop-verifier", "verifier-pw")
    try:
        assert not anonymous.connected.is_set()
        assert not wrong.connected.is_set()
        assert not unknown.connected.is_set()
        assert right.connected.is_set()
    finally:
        for c in (anonymous, wrong, unknown, right):
            c.close()


def test_tls_with_dev_ca_works_and_plaintext_to_tls_port_fails(
    secure_broker: SecureBroker,
) -> None:
    ca = secure_broker.folder / "ca.crt"
    tls = Client(secure_broker.service_port, "edgeloop-api", "api-pw", ca_file=ca)
    plain = Client(secure_broker.service_port, "edgeloop-api", "api-pw", timeout=2)
    no_ca = Client(secure_broker.service_port, "edgeloop-api", "api-pw", ca_file=None)
    try:
        assert tls.connected.is_set()
        assert not plain.connected.is_set()
        assert not no_ca.connected.is_set()
    finally:
        for c in (tls, plain, no_ca):
            c.close()


def test_agent_confined_to_its_own_topics(secure_broker: SecureBroker) -> None:
    files = secure_broker.files
    user_a, pw_a = add_agent(files, "fleet-a", "cam-a", TOPICS)
    user_b, pw_b = add_agent(files, "fleet-a", "cam-b", TOPICS)
    user_c, pw_c = add_agent(files, "fleet-z", "cam-c", TOPICS)
    port, ca = secure_broker.tls_port, secure_broker.ca_file
    verifier = Client(secure_broker.plain_port, "edgeloop-verifier", "verifier-pw")
    a = _once_reloaded(lambda: Client(port, user_a, pw_a, ca_file=ca))
    b = _once_reloaded(lambda: Client(port, user_b, pw_b, ca_file=ca))
    c = _once_reloaded(lambda: Client(port, user_c, pw_c, ca_file=ca))
    clients = [verifier, a, b, c]
    try:
        assert all(x.connected.is_set() for x in clients), "enrolled agents must connect"
        verifier.subscribe("$share/verifiers/edgeloop/v1/+/+/samples")
        verifier.subscribe("edgeloop/v1/+/+/status")

        # A publishes under B's id and under another fleet: nothing reaches the verifier.
        a.publish(TOPICS.samples("fleet-a", "cam-b"), b"forged-b")
        a.publish(TOPICS.samples("fleet-z", "cam-c"), b"forged-c")
        a.publish(TOPICS.status("fleet-a", "cam-b"), b"forged-status")
        a.publish(TOPICS.verdicts("fleet-a", "cam-b"), b"forged-verdict")
        a.publish(TOPICS.samples("fleet-a", "cam-a"), b"own")
        # A's messages reach the broker, and from it the verifier, in the order A sent
        # them: a forged one let through would have arrived before "own".
        assert _wait(lambda: (TOPICS.samples("fleet-a", "cam-a"), b"own") in verifier.received)
        payloads = [p for _, p in verifier.received]
        assert payloads == [b"own"], payloads

        # A tries to read B's verdicts (explicitly and by wildcard): refused, nothing arrives.
        a.subscribe(TOPICS.verdicts("fleet-a", "cam-b"))
        a.subscribe("edgeloop/v1/fleet-a/+/verdicts")
        a.subscribe(TOPICS.verdicts("fleet-a", "cam-a"))
        b.subscribe(TOPICS.verdicts("fleet-a", "cam-b"))
        a.subscribe(TOPICS.fleet_models("fleet-a"))
        c.subscribe(TOPICS.fleet_models("fleet-a"))  # another fleet's announcements
        verifier.publish(TOPICS.verdicts("fleet-a", "cam-b"), b"verdict-for-b")
        verifier.publish(TOPICS.verdicts("fleet-a", "cam-a"), b"verdict-for-a")
        verifier.publish(TOPICS.fleet_models("fleet-a"), b"announcement")
        c_own = TOPICS.verdicts("fleet-z", "cam-c")
        c.subscribe(c_own)
        verifier.publish(c_own, b"verdict-for-c")  # after everything C must not get
        assert _wait(lambda: (TOPICS.verdicts("fleet-a", "cam-b"), b"verdict-for-b") in b.received)
        # The verifier's messages reach each subscriber in the order they were sent:
        # once A has the announcement (sent last to A) and C its own verdict, anything
        # let through to them would have arrived already.
        assert _wait(lambda: (TOPICS.fleet_models("fleet-a"), b"announcement") in a.received)
        assert _wait(lambda: (c_own, b"verdict-for-c") in c.received)
        # Mosquitto grants the wildcard subscription but checks read rights per
        # message; overlapping subscriptions may deliver A's own verdict twice.
        a_payloads = {p for _, p in a.received}
        assert a_payloads == {b"announcement", b"verdict-for-a"}, a_payloads
        assert b"verdict-for-b" not in a_payloads
        assert c.received == [(c_own, b"verdict-for-c")]
    finally:
        for x in clients:
            x.close()


def test_enrollment_issues_broker_credentials_that_work(
    secure_broker: SecureBroker, make_settings: Any, tmp_path: Path
) -> None:
    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'e.db'}",
        admin_token="test-admin-token",
        broker_auth=True,
        broker_config_dir=secure_broker.folder,
        mqtt_url=f"mqtt://127.0.0.1:{secure_broker.plain_port}",
        mqtt_username="edgeloop-api",
        mqtt_password="api-pw",
        rollout_tick_s=0,
    )
    admin = {"Authorization": "Bearer test-admin-token"}
    with TestClient(create_app(settings)) as api:
        token = api.post(
            "/v1/enrollment-tokens", json={"fleet": "fleet-a", "agent_id": "cam-9"}, headers=admin
        ).json()["token"]
        answer = api.post("/v1/enroll", json={"token": token}).json()
    assert answer["mqtt_username"] == "fleet-a.cam-9"
    assert answer["mqtt_password"] and answer["mqtt_password"] != "api-pw"
    agent = _once_reloaded(
        lambda: Client(
            secure_broker.tls_port,
            answer["mqtt_username"],
            answer["mqtt_password"],
            ca_file=secure_broker.ca_file,
        )
    )
    try:
        assert agent.connected.is_set()
    finally:
        agent.close()
    assert BrokerFiles(secure_broker.files.password_file, secure_broker.files.acl_file)
    assert "user fleet-a.cam-9" in secure_broker.files.acl_file.read_text()


def test_the_agents_link_publishes_and_receives_over_tls(secure_broker: SecureBroker) -> None:
    """The agent's MQTT link (its own select over paho's external-loop calls) with TLS:
    a sample larger than a TLS record goes out, a burst of verdicts comes back (TLS
    bytes already decrypted are read without waiting in select)."""
    from edge_agent.uplink import MqttLink
    from shared.mqtt import MqttTarget

    user, password = add_agent(secure_broker.files, "fleet-a", "cam-t", TOPICS)
    ca = secure_broker.folder / "ca.crt"
    # The broker has reloaded its files once it lets this user in (then it leaves).
    _once_reloaded(lambda: Client(secure_broker.tls_port, user, password, ca_file=ca)).close()
    verifier = Client(secure_broker.service_port, "edgeloop-verifier", "verifier-pw", ca_file=ca)
    target = MqttTarget.parse(
        f"mqtts://127.0.0.1:{secure_broker.tls_port}",
        username=user,
        password=password,
        ca_file=str(ca),
    )
    received: list[tuple[str, bytes]] = []
    link = MqttLink(target, client_id=user, subscriptions=[TOPICS.verdicts("fleet-a", "cam-t")])
    link.set_handlers(
        on_message=lambda topic, payload: received.append((topic, payload)),
        on_connect=lambda: None,
    )
    link.start()
    try:
        assert verifier.connected.is_set()
        verifier.subscribe("$share/verifiers/edgeloop/v1/+/+/samples")
        assert _wait(lambda: link.connected)
        sample = bytes(range(256)) * 240  # 60 KB: several TLS records
        link.publish(TOPICS.samples("fleet-a", "cam-t"), sample)
        # The link subscribes before it counts as connected, so the broker had its
        # subscription before this sample: the verdicts below find it in place.
        assert _wait(lambda: (TOPICS.samples("fleet-a", "cam-t"), sample) in verifier.received)
        verdicts = [b"verdict-%d" % i for i in range(20)]
        for verdict in verdicts:
            verifier.client.publish(TOPICS.verdicts("fleet-a", "cam-t"), verdict, qos=1)
        assert _wait(lambda: len(received) == len(verdicts))
        assert [payload for _, payload in received] == verdicts
    finally:
        link.stop()
        verifier.close()
