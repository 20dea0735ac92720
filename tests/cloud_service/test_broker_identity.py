"""Per-agent broker identity on a real Mosquitto started from the generated configuration.

An enrolled agent cannot take over a service's session by its client id, cannot log
in on the services' listeners, cannot forge receipts, verdicts or announcements, and
cannot push a packet larger than the largest sample envelope; enrollment hands out
per-agent credentials only, never a service's, and none at all with ``broker_auth`` off.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_service.api import create_app
from cloud_service.brokerconf import (
    SERVICE_USERS,
    add_agent,
    check_password,
    max_packet_size,
    service_files,
)
from shared.topics import Topics
from tests.cloud_service.conftest import wait_until
from tests.cloud_service.test_broker_acl import TOPICS, Client, SecureBroker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette wants httpx2; the httpx we have works
    from fastapi.testclient import TestClient

pytestmark = [pytest.mark.mqtt]

PACKET_LIMIT = max_packet_size(4096, 2_000_000)  # the settings' default envelope limits
SAMPLES = "$share/verifiers/edgeloop/v1/+/+/samples"
ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[SecureBroker]:
    broker = SecureBroker(tmp_path / "broker", packet_limit=PACKET_LIMIT)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _agent(broker: SecureBroker, agent: str, **kwargs: Any) -> tuple[Client, str, str]:
    user, password = add_agent(broker.files, "fleet-a", agent, TOPICS)
    # add_agent signalled the broker to reload; retry until the new user is known.
    client: list[Client] = []

    def connected() -> bool:
        attempt = Client(broker.tls_port, user, password, ca_file=broker.ca_file, **kwargs)
        if attempt.connected.is_set():
            client.append(attempt)
            return True
        attempt.close()
        return False

    assert wait_until(connected, 10, step=0.05), f"{user} never connected"
    return client[0], user, password


def _verifier(broker: SecureBroker, **kwargs: Any) -> Client:
    verifier = Client(
        broker.service_port,
        "edgeloop-verifier",
        broker.passwords["edgeloop-verifier"],
        ca_file=broker.ca_file,
        **kwargs,
    )
    assert verifier.connected.is_set()
    return verifier


def test_an_agent_cannot_take_over_the_verifiers_session(broker: SecureBroker) -> None:
    verifier = _verifier(broker, client_id="edgeloop-verifier-1", session_expiry_s=3600)
    sender, _, _ = _agent(broker, "cam-s")
    _, user, password = _agent(broker, "cam-x")  # the attacker's credentials
    attempts: list[Client] = []
    try:
        verifier.subscribe(SAMPLES)
        sent = [b"sample-%d" % i for i in range(20)]
        for payload in sent:
            # Each sample goes out while an enrolled agent connects under the verifier's id.
            attempts.append(
                Client(
                    broker.tls_port,
                    user,
                    password,
                    ca_file=broker.ca_file,
                    client_id="edgeloop-verifier-1",
                )
            )
            sender.publish(TOPICS.samples("fleet-a", "cam-s"), payload)
        assert wait_until(lambda: len(verifier.received) >= len(sent), 20, step=0.02)
        assert [p for _, p in verifier.received] == sent
        assert verifier.disconnects == [], verifier.disconnects
        assert verifier.client.is_connected()
    finally:
        for client in (verifier, sender, *attempts):
            client.close()


def test_agent_credentials_are_refused_on_the_service_listeners(broker: SecureBroker) -> None:
    agent, user, password = _agent(broker, "cam-l")
    on_tls = Client(broker.service_port, user, password, ca_file=broker.ca_file)
    on_plain = Client(broker.plain_port, user, password)
    # And a service user is no agent: it does not log in on the agents' listener.
    service = Client(
        broker.tls_port,
        "edgeloop-verifier",
        broker.passwords["edgeloop-verifier"],
        ca_file=broker.ca_file,
    )
    try:
        assert agent.connected.is_set()
        assert not on_tls.connected.is_set()
        assert not on_plain.connected.is_set()
        assert not service.connected.is_set()
    finally:
        for client in (agent, on_tls, on_plain, service):
            client.close()


def test_agents_cannot_forge_receipts_verdicts_or_announcements(broker: SecureBroker) -> None:
    a, _, _ = _agent(broker, "cam-a")
    b, _, _ = _agent(broker, "cam-b")
    watcher = _verifier(broker)  # sees everything delivered under the prefix
    try:
        watcher.subscribe("edgeloop/v1/#")
        for agent_client, agent in ((a, "cam-a"), (b, "cam-b")):
            for own in (TOPICS.receipts, TOPICS.verdicts, TOPICS.agent_models):
                agent_client.subscribe(own("fleet-a", agent))
        a.subscribe(TOPICS.fleet_models("fleet-a"))
        b.subscribe(TOPICS.fleet_models("fleet-a"))
        forged = {
            TOPICS.receipts("fleet-a", "cam-a"): b"forged-own-receipt",
            TOPICS.verdicts("fleet-a", "cam-a"): b"forged-own-verdict",
            TOPICS.receipts("fleet-a", "cam-b"): b"forged-receipt-for-b",
            TOPICS.verdicts("fleet-a", "cam-b"): b"forged-verdict-for-b",
            TOPICS.agent_models("fleet-a", "cam-b"): b"forged-model-for-b",
            TOPICS.fleet_models("fleet-a"): b"forged-fleet-announcement",
        }
        for topic, payload in forged.items():
            reason = a.publish(topic, payload)
            assert reason is not None and reason.is_failure, (topic, reason)
        # The real ones, sent after the forged ones were answered, arrive; nothing forged does.
        real = {
            TOPICS.receipts("fleet-a", "cam-a"): b"real-receipt-a",
            TOPICS.verdicts("fleet-a", "cam-b"): b"real-verdict-b",
        }
        for topic, payload in real.items():
            watcher.publish(topic, payload)
        assert wait_until(
            lambda: (TOPICS.receipts("fleet-a", "cam-a"), b"real-receipt-a") in a.received, 10
        )
        assert wait_until(
            lambda: (TOPICS.verdicts("fleet-a", "cam-b"), b"real-verdict-b") in b.received, 10
        )
        assert wait_until(lambda: len(watcher.received) >= len(real), 10)
        seen = {p for _, p in (*a.received, *b.received, *watcher.received)}
        assert seen.isdisjoint(forged.values()), seen & set(forged.values())
    finally:
        for client in (a, b, watcher):
            client.close()


def test_a_publish_over_the_packet_limit_drops_the_connection(broker: SecureBroker) -> None:
    verifier = _verifier(broker)
    agent, _, _ = _agent(broker, "cam-big")
    marker, _, _ = _agent(broker, "cam-m")
    try:
        verifier.subscribe(SAMPLES)
        topic = TOPICS.samples("fleet-a", "cam-big")
        largest = bytes(4096 + 2_000_000)  # the largest envelope the cloud accepts
        assert agent.publish(topic, largest) is not None
        assert wait_until(lambda: any(len(p) == len(largest) for _, p in verifier.received), 20)
        assert agent.disconnects == []

        oversized = bytes(PACKET_LIMIT + 1)
        agent.publish(topic, oversized)
        assert wait_until(lambda: agent.disconnects, 20), "the broker kept the connection"
        marker.publish(TOPICS.samples("fleet-a", "cam-m"), b"after")
        assert wait_until(
            lambda: (TOPICS.samples("fleet-a", "cam-m"), b"after") in verifier.received, 10
        )
        assert all(len(p) <= len(largest) for _, p in verifier.received)
    finally:
        for client in (verifier, agent, marker):
            client.close()


def _enroll(api: TestClient, agent_id: str) -> dict[str, Any]:
    token = api.post(
        "/v1/enrollment-tokens", json={"fleet": "fleet-a", "agent_id": agent_id}, headers=ADMIN
    ).json()["token"]
    answer = api.post("/v1/enroll", json={"token": token})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_enrollment_without_broker_auth_hands_out_no_credentials(
    make_settings: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'e.db'}",
        admin_token="test-admin-token",
        broker_auth=False,
        # The cloud's own broker user, which may read and write every topic.
        mqtt_username="edgeloop-api",
        mqtt_password="api-pw",
        rollout_tick_s=0,
    )
    with caplog.at_level("WARNING"), TestClient(create_app(settings)) as api:
        answer = _enroll(api, "cam-1")
    assert answer["mqtt_username"] is None and answer["mqtt_password"] is None
    assert "api-pw" not in str(answer)
    assert any("WITHOUT broker credentials" in r.getMessage() for r in caplog.records)

    # The agent says so too, and so does the cloud when it starts.
    from cloud_service.cli import _warn_if_anonymous_broker
    from edge_agent.enroll import enroll

    caplog.clear()
    with caplog.at_level("WARNING"):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
        enroll("http://cloud.test", "a-token-value", transport=transport)
        _warn_if_anonymous_broker(settings)
    messages = [r.getMessage() for r in caplog.records]
    assert any("NO broker credentials" in m and "development only" in m for m in messages)
    assert any("BROKER IS ANONYMOUS (development only)" in m for m in messages)


def test_enrollment_with_broker_auth_issues_per_agent_credentials(
    broker: SecureBroker, make_settings: Any, tmp_path: Path
) -> None:
    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'e.db'}",
        admin_token="test-admin-token",
        broker_auth=True,
        broker_config_dir=broker.folder,
        mqtt_url=f"mqtt://127.0.0.1:{broker.plain_port}",
        mqtt_username="edgeloop-api",
        mqtt_password=broker.passwords["edgeloop-api"],
        rollout_tick_s=0,
    )
    with TestClient(create_app(settings)) as api:
        answers = [_enroll(api, agent) for agent in ("cam-1", "cam-2")]
    users = [a["mqtt_username"] for a in answers]
    passwords = [a["mqtt_password"] for a in answers]
    assert users == ["fleet-a.cam-1", "fleet-a.cam-2"]
    assert len(set(passwords)) == 2 and all(passwords)
    assert not set(users) & set(SERVICE_USERS)
    assert not set(passwords) & set(broker.passwords.values())
    service_hashes = service_files(broker.folder).password_file.read_text()
    assert not any(user in service_hashes for user in users)
    for line in service_hashes.splitlines():
        assert not any(check_password(p, line.split(":", 1)[1]) for p in passwords)
    clients = [
        Client(broker.tls_port, u, p, ca_file=broker.ca_file)
        for u, p in zip(users, passwords, strict=True)
    ]
    try:
        assert wait_until(lambda: all(c.connected.is_set() for c in clients), 10)
    finally:
        for client in clients:
            client.close()


def test_an_agent_keeps_its_persistent_session(broker: SecureBroker) -> None:
    """The broker names an agent's session after its user; the agent's link must never
    connect with a clean start under it, or verdicts queued while it was away are lost."""
    from edge_agent.uplink import MqttLink
    from shared.mqtt import MqttTarget

    user, password = add_agent(broker.files, "fleet-a", "cam-p", TOPICS)
    target = MqttTarget.parse(
        f"mqtts://127.0.0.1:{broker.tls_port}",
        username=user,
        password=password,
        ca_file=str(broker.ca_file),
    )
    topic = Topics(prefix="edgeloop/v1").verdicts("fleet-a", "cam-p")
    verifier = _verifier(broker)
    received: list[bytes] = []

    def link() -> MqttLink:
        made = MqttLink(target, client_id="edgeloop-agent-fleet-a-cam-p", subscriptions=[topic])
        made.set_handlers(on_message=lambda t, p: received.append(p), on_connect=lambda: None)
        made.start()
        return made

    first = link()
    try:
        # Until the link's subscription is in place, pings go nowhere; one arrives then.
        def pinged() -> bool:
            if not received:
                verifier.publish(topic, b"ping")
            return bool(received)

        assert wait_until(pinged, 20)
    finally:
        first.stop()
    assert not first.connected
    verifier.publish(topic, b"while-away")
    second = link()
    try:
        assert wait_until(lambda: b"while-away" in received, 20), received
    finally:
        second.stop()
        verifier.close()
