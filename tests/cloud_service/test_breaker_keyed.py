"""The breaker isolates bad messages, not the agent: junk on its topic cannot starve it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from cloud_service.db.models import Agent, DeadLetter, Sample
from cloud_service.settings import CloudSettings
from shared.messages import Receipt
from shared.topics import Topics
from tests.cloud_service.conftest import make_envelope, publisher
from tests.cloud_service.test_worker import _wait, running_worker

pytestmark = [pytest.mark.mqtt, pytest.mark.sql]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_junk_on_an_agents_topic_does_not_stop_its_samples(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Topics,
    database_url: str,
    collector_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet, agent = "fleet-a", "cam-1"
    topic = topics.samples(fleet, agent)
    collector = collector_factory(broker.url, [topics.receipts(fleet, agent)], broker.protocol)
    caplog.set_level(logging.INFO, logger="cloud_service.verifier_recovery")
    # The breaker's defaults (20 messages, half refused, 300 s), as deployed.
    with running_worker(
        make_settings, broker, topics, database_url, breaker_log_every_s=3600
    ) as worker:
        with worker.sessions.begin() as session:
            session.add(Agent(agent_id=agent, fleet=fleet, telemetry={}, state="online"))
        pub = publisher(broker.url, broker.protocol)
        junk = 0
        for _ in range(25):  # anyone on the broker can publish these on the agent's topic
            pub.publish(topic, b"\x00junk" * 200, qos=1)
            junk += 1
        genuine: list[str] = []
        for _ in range(10):
            header, envelope = make_envelope(fleet=fleet, agent=agent)
            genuine.append(header.sample_id)
            pub.publish(topic, envelope, qos=1)
            pub.publish(topic, b"\x00more junk" * 100, qos=1)  # and it goes on
            junk += 1
        pub.publish(topic, b"ELSE", qos=1).wait_for_publish(10)
        junk += 1
        assert _wait(lambda: worker.counts["dead_letters"] >= junk, 60)
        assert _wait(lambda: worker.counts["stored"] >= len(genuine), 60)

        def receipted() -> set[str]:
            ids: set[str] = set()
            for _topic, payload in collector.messages:
                ids.update(Receipt.model_validate_json(payload).sample_ids)
            return ids

        assert collector.wait_for(lambda: receipted() >= set(genuine), 60)
        with worker.sessions() as session:
            stored = set(session.scalars(select(Sample.sample_id)))
            letters = list(session.execute(select(DeadLetter.reason, DeadLetter.payload)))
            state = session.scalar(select(Agent.state).where(Agent.agent_id == agent))
        pub.loop_stop()
        pub.disconnect()
    assert set(genuine) <= stored
    assert len(letters) == junk and worker.counts["dead_letters"] == junk
    isolated = [payload for reason, payload in letters if reason == "isolated"]
    # Once the breaker opened, junk costs no stored bytes.
    assert len(isolated) >= junk - 20 and all(p == b"" for p in isolated)
    assert state == "isolated"  # still shown: its topic carries mostly junk
    metrics = worker.metrics.render().decode()
    assert f'edgeloop_dead_letters_total{{reason="isolated"}} {float(len(isolated))}' in metrics
    assert 'edgeloop_agent_isolations_total{agent="cam-1",fleet="fleet-a"} 1.0' in metrics
    # A flood of junk is not a flood of log lines: one per reason and interval.
    lines = [r for r in caplog.records if r.getMessage().startswith("dead letter on")]
    assert len(lines) <= 3
