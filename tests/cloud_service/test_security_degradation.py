"""Degradation ladder in the verifier: a per-agent circuit breaker, shedding by priority."""

from __future__ import annotations

import warnings
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from cloud_service.api import create_app
from cloud_service.db.models import Agent, DeadLetter, Sample
from cloud_service.ingest import AgentBreaker, SampleTask
from shared.tasks import Answer
from tests.cloud_service.conftest import make_envelope, publisher
from tests.cloud_service.test_worker import _wait, running_worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette wants httpx2; the httpx we have works
    from fastapi.testclient import TestClient


def test_breaker_opens_on_error_rate_and_closes_after_cooldown() -> None:
    breaker = AgentBreaker(window_s=10, min_messages=4, error_rate=0.5, cooldown_s=30)
    for i in range(3):
        assert not breaker.record("f", "bad", ok=False, now=i)
    assert breaker.record("f", "bad", ok=False, now=3)  # 4 of 4 refused: open
    assert breaker.isolated_until("f", "bad", now=4) == 33
    for i in range(10):
        assert not breaker.record("f", "good", ok=i % 3 != 0, now=i)  # 4 of 10 refused
    assert breaker.isolated(now=5) == [("f", "bad")]
    assert breaker.isolated_until("f", "bad", now=40) is None  # cool-down over
    assert breaker.isolated(now=40) == []


@pytest.mark.mqtt
@pytest.mark.sql
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_flooding_agent_is_isolated_and_shown(make_settings, broker, topics, database_url) -> None:
    fleet = "fleet-a"
    with running_worker(
        make_settings,
        broker,
        topics,
        database_url,
        breaker_min_messages=10,
        breaker_error_rate=0.5,
        breaker_cooldown_s=600,
        admin_token="test-admin-token",
        rollout_tick_s=0,
    ) as worker:
        with worker.sessions.begin() as session:
            for agent in ("cam-bad", "cam-good"):
                session.add(Agent(agent_id=agent, fleet=fleet, telemetry={}, state="online"))
        pub = publisher(broker.url, broker.protocol)
        for _ in range(30):
            pub.publish(topics.samples(fleet, "cam-bad"), b"\x00garbage" * 10, qos=1)
        good = []
        for _ in range(10):
            header, envelope = make_envelope(fleet=fleet, agent="cam-good")
            good.append(header.sample_id)
            pub.publish(topics.samples(fleet, "cam-good"), envelope, qos=1)
        # The breaker isolates bad messages, not the agent: anyone can publish junk on
        # its topic, so a well-formed sample from it is still taken.
        header, envelope = make_envelope(fleet=fleet, agent="cam-bad")
        pub.publish(topics.samples(fleet, "cam-bad"), envelope, qos=1).wait_for_publish(5)
        assert _wait(lambda: worker.counts["dead_letters"] >= 30)
        assert _wait(lambda: worker.counts["stored"] >= 11)
        with worker.sessions() as session:
            reasons = [r for (r,) in session.execute(select(DeadLetter.reason))]
            stored = set(session.scalars(select(Sample.sample_id)))
            states = dict(session.execute(select(Agent.agent_id, Agent.state)).all())
        assert reasons.count("isolated") >= 30 - 10  # everything after the breaker opened
        assert set(good) <= stored and header.sample_id in stored
        assert states == {"cam-bad": "isolated", "cam-good": "online"}
        metrics = worker.metrics.render().decode()
        assert "edgeloop_isolated_agents 1.0" in metrics
        assert 'edgeloop_dead_letters_total{reason="isolated"}' in metrics
        with TestClient(create_app(worker.settings, migrate=False)) as api:
            listed = api.get("/v1/agents", headers={"Authorization": "Bearer test-admin-token"})
            shown = {a["agent_id"]: a["state"] for a in listed.json()["items"]}
        assert shown["cam-bad"] == "isolated"
        pub.loop_stop()
        pub.disconnect()


def _task(priority: int) -> SampleTask:
    from shared.ids import new_sample_id

    return SampleTask(
        sample_id=new_sample_id(),
        fleet="f",
        agent="a",
        captured_at=datetime.now(UTC),
        edge=Answer(0, 0.4, (0.4, 0.6)),
        priority=priority,
        pixels=np.zeros((3, 32, 32), np.float32),
    )


def test_overload_sheds_audit_samples_first(make_settings, tmp_path) -> None:
    from cloud_service.worker import VerifierWorker

    settings = make_settings(
        database_url=f"sqlite:///{tmp_path / 'shed.db'}",
        shed_queue_depth=100,
        shed_priority_at_least=8,
    )
    worker = VerifierWorker(settings)
    submitted: list[Any] = []

    class Loaded:
        depth = 150
        config = SimpleNamespace(priority_levels=10)

        def queue_many(self, requests: list[tuple[SampleTask, Any, int, float]]) -> None:
            submitted.extend(task for task, *_ in requests)

    verdicts = worker.verdicts
    real = verdicts.batcher
    verdicts.batcher = Loaded()  # type: ignore[assignment]
    try:
        audit, urgent = _task(9), _task(0)
        verdicts.submit(audit)
        verdicts.submit(urgent)
        assert submitted == [urgent]
        assert worker.shed_count == 1
        assert not verdicts.in_flight(audit.sample_id)  # the recovery scan may submit it later
        assert 'edgeloop_verifier_shed_total{priority="9"} 1.0' in worker.metrics.render().decode()
        Loaded.depth = 10  # drained: audit samples go through again
        verdicts.submit(audit)
        assert submitted == [urgent, audit]
    finally:
        verdicts.batcher = real
        worker.stop()
