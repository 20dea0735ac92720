"""End-to-end delivery on a real Mosquitto: broker outages and agent restarts lose nothing.

The fake cloud stores samples by id and receipts them, as the real one does. Each
test prints its counts (run with ``-s`` to see them). The resend timeout is short
here (2 s) because a restarted broker may come back without its sessions (the
private Mosquitto cannot always write its persistence file): then what the cloud's
lost session would have queued is recovered by the agent's resend, not the broker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from shared.topics import Topics

pytestmark = pytest.mark.mqtt


def frames(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for _ in range(n)]


def test_broker_outage_loses_nothing(
    mosquitto: object,
    topics: Topics,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    fake_cloud_factory: Callable[..., object],
    until: Callable[..., bool],
) -> None:
    settings = make_settings(
        mqtt_url=mosquitto.url,  # type: ignore[attr-defined]
        topic_prefix=topics.prefix,
        route_max_prob_below=1.01,  # forward every frame
        audit_share=0.0,
        resend_after_s=2.0,
    )
    cloud = fake_cloud_factory(mosquitto.url, topics)  # type: ignore[attr-defined]
    forwarded: list[str] = []
    answered = 0
    stop = threading.Event()
    lock = threading.Lock()
    pool = frames(16)

    with Agent(settings, engine=engine) as agent:  # type: ignore[arg-type]
        assert until(lambda: agent.publisher.connected, timeout=10)

        def stream() -> None:
            nonlocal answered
            i = 0
            while not stop.is_set() and i < 2000:
                result = agent.process(pool[i % len(pool)], source="test")
                with lock:
                    answered += 1
                    if result.forwarded:
                        forwarded.append(result.sample_id)
                i += 1
                time.sleep(0.01)

        streamers = [threading.Thread(target=stream, name=f"stream-{k}") for k in range(2)]
        for t in streamers:
            t.start()
        # Some samples forwarded and delivered before the outage ...
        assert until(lambda: len(forwarded) >= 5, timeout=60)
        mosquitto.stop()  # type: ignore[attr-defined]
        assert until(lambda: not agent.publisher.connected, timeout=60)
        with lock:
            answered_at_outage, forwarded_at_outage = answered, len(forwarded)
        # ... frames answered and samples spooled while the broker is down ...
        assert until(
            lambda: (
                answered > answered_at_outage + 20 and len(forwarded) >= forwarded_at_outage + 5
            ),
            timeout=60,
        )
        with lock:
            answered_during_outage = answered - answered_at_outage
        depth_during_outage = agent.spool.depth
        mosquitto.start()  # type: ignore[attr-defined]
        # ... and more after it, on the restored connection.
        assert until(lambda: agent.publisher.connected, timeout=60)
        with lock:
            forwarded_after = len(forwarded)
        assert until(lambda: len(forwarded) >= forwarded_after + 5, timeout=60)
        stop.set()
        for t in streamers:
            t.join(10)

        expected = set(forwarded)
        assert until(lambda: expected <= cloud.stored, timeout=30), (  # type: ignore[attr-defined]
            f"missing {len(expected - cloud.stored)} of {len(expected)}"  # type: ignore[attr-defined]
        )
        assert until(lambda: agent.spool.depth == 0, timeout=15)
        stats = agent.spool.stats()

    print(
        f"\nOUTAGE: answered={answered} (during outage {answered_during_outage}),"
        f" forwarded={len(forwarded)}, distinct_forwarded={len(expected)},"
        f" spool_depth_during_outage={depth_during_outage},"
        f" cloud_deliveries={len(cloud.received)}, cloud_distinct={len(cloud.stored)},"  # type: ignore[attr-defined]
        f" duplicates={cloud.duplicates}, extra_ids={len(cloud.stored - expected)},"  # type: ignore[attr-defined]
        f" spool_acked={stats.acked}, evicted={stats.evicted_audit + stats.evicted_oldest}"
    )
    assert len(expected) == len(forwarded)  # ids are unique
    assert cloud.stored == expected  # type: ignore[attr-defined]
    assert answered_during_outage > 20  # the agent kept answering with the broker down
    assert depth_during_outage > 0  # and the spool grew
    assert stats.evicted_audit + stats.evicted_oldest == 0


def test_restart_with_a_full_spool_loses_nothing(
    mosquitto: object,
    topics: Topics,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    fake_cloud_factory: Callable[..., object],
    until: Callable[..., bool],
) -> None:
    settings = make_settings(
        mqtt_url=mosquitto.url,  # type: ignore[attr-defined]
        topic_prefix=topics.prefix,
        route_max_prob_below=1.01,
        resend_after_s=2.0,
    )
    # A cloud that receives but does not receipt yet (say it is slow to store).
    cloud = fake_cloud_factory(mosquitto.url, topics, receipts=False)  # type: ignore[attr-defined]
    with Agent(settings, engine=engine) as agent:  # type: ignore[arg-type]
        assert until(lambda: agent.publisher.connected, timeout=10)
        forwarded = [agent.process(f, source="test").sample_id for f in frames(40)]
        assert until(lambda: len(cloud.stored) == 40, timeout=15)  # type: ignore[attr-defined]
        depth_at_stop = agent.spool.depth
    assert depth_at_stop == 40  # delivered to the broker and the cloud, but not receipted

    # Broker down while the agent is down, frames arriving before it comes back.
    mosquitto.stop()  # type: ignore[attr-defined]
    with Agent(settings, engine=engine) as agent:  # type: ignore[arg-type]
        assert agent.spool.depth == 40
        forwarded += [agent.process(f, source="test").sample_id for f in frames(10, seed=1)]
        cloud.send_receipts = True  # type: ignore[attr-defined]
        mosquitto.start()  # type: ignore[attr-defined]
        drained = until(lambda: agent.spool.depth == 0, timeout=30)
        assert drained, (
            f"spool depth {agent.spool.depth}, link connected {agent.publisher.connected},"
            f" cloud connected {cloud.connected.is_set()}, cloud got {len(cloud.received)},"  # type: ignore[attr-defined]
            f" link error {getattr(agent.publisher, 'last_error', None)},"
            f" stats {agent.spool.stats()},"
            f" link connects {getattr(agent.publisher, 'connects', None)}"
            f" published {getattr(agent.publisher, 'published', None)}"
        )
    print(
        f"\nRESTART: forwarded={len(forwarded)}, spool_at_stop={depth_at_stop},"
        f" cloud_deliveries={len(cloud.received)}, cloud_distinct={len(cloud.stored)},"  # type: ignore[attr-defined]
        f" duplicates={cloud.duplicates}"  # type: ignore[attr-defined]
    )
    assert cloud.stored == set(forwarded)  # type: ignore[attr-defined]


def test_last_will_and_status(
    mosquitto: object,
    topics: Topics,
    make_settings: Callable[..., AgentSettings],
    engine: object,
    until: Callable[..., bool],
) -> None:
    """The retained status says online while running and offline after a clean stop."""
    import paho.mqtt.client as mqtt

    from shared.messages import AgentStatus, decode_message
    from shared.mqtt import MqttTarget, make_client

    settings = make_settings(mqtt_url=mosquitto.url, topic_prefix=topics.prefix)  # type: ignore[attr-defined]
    seen: list[AgentStatus] = []
    watcher = make_client(MqttTarget.parse(mosquitto.url), client_id="status-watcher")  # type: ignore[attr-defined]

    def on_message(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        seen.append(decode_message(message.payload, AgentStatus))

    watcher.on_message = on_message
    watcher.on_connect = lambda c, *a: c.subscribe(topics.status("test-fleet", "agent-1"), qos=1)
    watcher.connect("127.0.0.1", mosquitto.port)  # type: ignore[attr-defined]
    watcher.loop_start()
    try:
        with Agent(settings, engine=engine) as agent:  # type: ignore[arg-type]
            assert until(lambda: any(s.state == "online" for s in seen), timeout=10)
            online = next(s for s in seen if s.state == "online")
            assert online.provider == "cpu"
            assert online.spool_depth == 0
            assert agent.publisher.connected
        assert until(lambda: seen[-1].state == "offline", timeout=10)
    finally:
        watcher.disconnect()
        watcher.loop_stop()
