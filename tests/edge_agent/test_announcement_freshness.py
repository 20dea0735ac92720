"""Announcements are fresh or refused: a replayed, expired or misdirected one installs nothing.

The announcements are the ones the cloud's registry signs and publishes (SQLite,
in-memory announcer); the agent fetches artifacts from an in-memory double of the
cloud's artifact route and receives announcements through the in-memory publisher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from cloud_service import registry
from cloud_service.announce import MemoryAnnouncer
from cloud_service.blobs import LocalBlobStore
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher, make_tiny_student
from shared.manifest import FleetSigningKey
from shared.messages import ModelStatus, decode_message, encode_message, sign_manifest
from shared.topics import Topics

FLEET = "test-fleet"
CLOUD = "http://127.0.0.1:8080"  # a loopback cloud: the agent sends its token over http
TOKEN = "agent-token"


@dataclass
class Cloud:
    """The registry side: a migrated SQLite database, blobs, the fleet key, an announcer."""

    sessions: sessionmaker[Session]
    blobs: LocalBlobStore
    key: FleetSigningKey
    announcer: MemoryAnnouncer
    topics: Topics

    def last(self, topic: str) -> bytes:
        return [raw for t, raw in self.announcer.published if t == topic][-1]

    def promote(self, version: str, *, now: datetime | None = None) -> bytes:
        with self.sessions.begin() as session:
            registry.promote(
                session=session,
                announcer=self.announcer,
                topics=self.topics,
                fleet=FLEET,
                name="tiny-student",
                version=version,
                key=self.key,
            )
            if now is not None:  # an announcement made at ``now`` (long ago)
                record = registry.get_version(session=session, name="tiny-student", version=version)
                raw = registry.signed_announcement(
                    session=session, key=self.key, record=record, fleet=FLEET, now=now
                )
                self.announcer.announce(self.topics.fleet_models(FLEET), raw)
        return self.last(self.topics.fleet_models(FLEET))

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return httpx.Response(401)
            _, _, _, name, version, _ = request.url.path.split("/")
            with self.sessions() as session:
                record = registry.get_version(session=session, name=name, version=version)
                return httpx.Response(200, content=self.blobs.get(record.artifact_key))

        return httpx.MockTransport(handle)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Cloud]:
    url = f"sqlite:///{tmp_path / 'cloud.db'}"
    upgrade_database(url)
    engine = make_engine(url)
    made = Cloud(
        sessions=make_session_factory(engine),
        blobs=LocalBlobStore(tmp_path / "blobs", fsync=False),
        key=FleetSigningKey.generate(),
        announcer=MemoryAnnouncer(),
        topics=Topics(),
    )
    with made.sessions.begin() as session:
        for version, seed in (("v2", 2), ("v3", 3)):
            path = make_tiny_student(
                tmp_path / f"{version}.onnx", size=32, seed=seed, version=version
            )
            registry.register_model(session=session, blobs=made.blobs, key=made.key, artifact=path)
    yield made
    engine.dispose()


AgentFactory = Callable[..., tuple[Agent, MemoryPublisher]]


@pytest.fixture
def start_agent(
    make_settings: Callable[..., AgentSettings], cloud: Cloud
) -> Iterator[AgentFactory]:
    running: list[Agent] = []

    def start(**overrides: Any) -> tuple[Agent, MemoryPublisher]:
        settings = make_settings(
            fleet_public_key=cloud.key.public_key_b64,
            cloud_url=CLOUD,
            api_token=TOKEN,
            topic_prefix=cloud.topics.prefix,
            **overrides,
        )
        publisher = MemoryPublisher()
        agent = Agent(
            settings, publisher=publisher, start_sources=False, model_transport=cloud.transport()
        )
        agent.__enter__()
        running.append(agent)
        return agent, publisher

    yield start
    for agent in running:
        stop(agent)


def stop(agent: Agent) -> None:
    if not getattr(agent, "_test_stopped", False):
        agent._test_stopped = True  # type: ignore[attr-defined]
        agent.stop()


def deliver(
    agent: Agent, publisher: MemoryPublisher, raw: bytes, until: Any, *, own: bool = False
) -> dict[str, Any]:
    before = agent.updater.last_result
    topic = agent.updater.topic_agent if own else agent.updater.topic_fleet
    publisher.deliver(topic, raw)
    assert until(lambda: agent.updater.last_result is not before, timeout=20)
    result = agent.updater.last_result
    assert result is not None
    return result


def serving(agent: Agent) -> str:
    frame = np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    return agent.process(frame, source="test").model_version


def refusals(publisher: MemoryPublisher) -> list[str]:
    steps = [decode_message(p, ModelStatus) for p in publisher.sent("/model-status")]
    return [s.reason or "" for s in steps if s.state == "rejected"]


def test_a_replayed_older_announcement_is_refused_and_the_agent_keeps_serving(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    agent, publisher = start_agent()
    older = cloud.promote("v2")
    newer = cloud.promote("v3")
    assert deliver(agent, publisher, older, until)["result"] == "active"
    assert deliver(agent, publisher, newer, until)["result"] == "active"
    # The older announcement is validly signed; published again, it must not downgrade.
    result = deliver(agent, publisher, older, until)
    assert result["result"] == "rejected" and result["reason"] == "stale", result
    assert serving(agent) == "v3"
    assert refusals(publisher)[-1].startswith("stale:")
    # The genuine announcement, redelivered (a reconnect), is still the current one.
    assert deliver(agent, publisher, newer, until)["result"] == "current"


def test_an_expired_announcement_is_refused(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    agent, publisher = start_agent()
    stale = cloud.promote("v2", now=datetime.now(UTC) - timedelta(days=31))
    result = deliver(agent, publisher, stale, until)
    assert result["result"] == "rejected" and result["reason"] == "expired", result
    assert serving(agent) == "test-1"


def test_a_cloud_rollback_is_a_newer_announcement_and_is_accepted(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    agent, publisher = start_agent()
    deliver(agent, publisher, cloud.promote("v2"), until)
    v3 = cloud.promote("v3")
    deliver(agent, publisher, v3, until)
    with cloud.sessions.begin() as session:
        registry.rollback(
            session=session,
            announcer=cloud.announcer,
            topics=cloud.topics,
            fleet=FLEET,
            name="tiny-student",
            key=cloud.key,
        )
    back = cloud.last(cloud.topics.fleet_models(FLEET))
    assert deliver(agent, publisher, back, until) == {"result": "active", "version": "v2"}
    assert serving(agent) == "v2"
    # And the announcement it replaced cannot bring v3 back.
    assert deliver(agent, publisher, v3, until)["reason"] == "stale"


def test_the_highest_sequence_survives_an_agent_restart(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    older = cloud.promote("v2")
    newer = cloud.promote("v3")
    agent, publisher = start_agent()
    deliver(agent, publisher, newer, until)
    stop(agent)
    restarted, publisher = start_agent()
    assert serving(restarted) == "v3"
    result = deliver(restarted, publisher, older, until)
    assert result["result"] == "rejected" and result["reason"] == "stale", result
    assert serving(restarted) == "v3"


def test_an_announcement_for_another_agent_is_refused(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    agent, publisher = start_agent()
    with cloud.sessions.begin() as session:
        registry.pin(
            session=session,
            announcer=cloud.announcer,
            topics=cloud.topics,
            fleet=FLEET,
            name="tiny-student",
            version="v2",
            agents=["agent-2"],
            key=cloud.key,
        )
    theirs = cloud.last(cloud.topics.agent_models(FLEET, "agent-2"))
    on_own_topic = deliver(agent, publisher, theirs, until, own=True)
    on_fleet_topic = agent.updater.apply(theirs, scope="fleet")
    # The fleet's announcement copied onto this agent's topic would hold it there.
    fleet_copy = agent.updater.apply(cloud.promote("v3"), scope="agent")
    for result in (on_own_topic, on_fleet_topic, fleet_copy):
        assert result["result"] == "rejected" and result["reason"] == "wrong_audience", result
    assert serving(agent) == "test-1"


def test_an_unsequenced_announcement_is_refused_in_production_only(
    cloud: Cloud, start_agent: AgentFactory, until: Any
) -> None:
    with cloud.sessions() as session:
        record = registry.get_version(session=session, name="tiny-student", version="v2")
        manifest = registry.ModelManifest.model_validate(record.manifest)
    old_style = encode_message(sign_manifest(manifest, cloud.key))  # as an older cloud signs
    agent, publisher = start_agent(env="production")
    result = deliver(agent, publisher, old_style, until)
    assert result["result"] == "rejected" and result["reason"] == "unsequenced", result
    stop(agent)
    developing, publisher = start_agent(data_dir=agent.settings.data_dir / "dev")
    assert deliver(developing, publisher, old_style, until)["result"] == "active"
