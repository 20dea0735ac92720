"""The MQTT link's backoff, and the agent's pump over an in-memory publisher."""

from __future__ import annotations

import random
from collections.abc import Callable

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher
from edge_agent.uplink import Backoff


def test_backoff_is_jittered_exponential_and_capped() -> None:
    backoff = Backoff(0.5, 8.0, random.Random(1))
    delays = [backoff.next_delay() for _ in range(12)]
    assert all(0.25 <= d <= 8.0 for d in delays)
    assert len(set(delays)) > 6  # jittered, not a fixed ladder
    ceilings = [min(8.0, 0.5 * 2**i) for i in range(12)]
    assert all(d <= c or d == 0.25 for d, c in zip(delays, ceilings, strict=True))
    backoff.reset()
    assert backoff.next_delay() <= 0.5


def test_spool_drains_only_on_receipts(
    make_settings: Callable[..., AgentSettings], engine: object, until: Callable[..., bool]
) -> None:
    import numpy as np

    publisher = MemoryPublisher(connected=False)
    settings = make_settings(route_max_prob_below=1.01)
    with Agent(settings, engine=engine, publisher=publisher) as agent:  # type: ignore[arg-type]
        for seed in range(5):
            frame = np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)
            assert agent.process(frame, source="test").forwarded
        assert agent.spool.depth == 5
        assert publisher.sent() == []  # nothing goes out while disconnected
        publisher.connect()
        assert until(lambda: len(publisher.sent()) == 5)
        assert agent.spool.depth == 5  # published is not delivered
        publisher.auto_receipt = True
        publisher.connect()  # a reconnect sends everything unreceipted again
        assert until(lambda: agent.spool.depth == 0)


def test_the_link_reports_connects_disconnects_and_the_last_error(broker: object) -> None:
    """What ``edge-agent status`` shows of the uplink, over a real broker."""
    import threading
    import uuid

    from edge_agent.uplink import MqttLink

    target = broker.target  # type: ignore[attr-defined]
    client_id = f"edgeloop-test-link-{uuid.uuid4().hex[:8]}"
    link = MqttLink(target, client_id=client_id, subscriptions=[])
    connected = threading.Event()
    link.set_handlers(on_message=lambda topic, payload: None, on_connect=connected.set)
    link.start()
    try:
        assert connected.wait(30)
        status = link.status()
        assert status["connected"] and status["connects"] == 1
        assert status["client_id"] == client_id
        assert status["broker"] == f"{target.host}:{target.port}"
        assert (status["disconnects"], status["outbox"], status["last_error"]) == (0, 0, None)
    finally:
        link.stop()
    assert not link.connected and link.health()["alive"] is False


def test_flush_returns_once_the_outbox_is_written(broker: object) -> None:
    """The agent's last 'offline' status: published, flushed, then the link stops."""
    import threading
    import uuid

    from edge_agent.uplink import MqttLink

    target = broker.target  # type: ignore[attr-defined]
    topic = f"edgeloop-test/{uuid.uuid4().hex[:8]}/status"
    link = MqttLink(
        target, client_id=f"edgeloop-test-flush-{uuid.uuid4().hex[:8]}", subscriptions=[]
    )
    connected = threading.Event()
    link.set_handlers(on_message=lambda topic, payload: None, on_connect=connected.set)
    link.start()
    try:
        assert connected.wait(30)
        for i in range(50):
            link.publish(topic, b"status %d" % i, qos=1)
        assert link.flush(30) and link.backlog == 0
    finally:
        link.stop()
    assert link.published == 50
