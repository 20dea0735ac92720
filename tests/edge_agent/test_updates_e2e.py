"""End to end on the real broker: the cloud registers and announces (retained), an agent
that was offline catches up on connect, fetches over HTTP from the cloud's server, and
swaps while frames flow without one failed frame."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service import registry
from cloud_service.announce import MqttAnnouncer
from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.settings import CloudSettings
from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.sources.http import ApiServer
from edge_agent.testing import make_tiny_student
from shared.mqtt import MqttTarget
from shared.topics import Topics

pytestmark = [pytest.mark.mqtt, pytest.mark.sql]


def test_offline_agent_catches_up_and_swaps_under_load(
    broker: Any,
    topics: Topics,
    tmp_path: Path,
    make_settings: Callable[..., AgentSettings],
    until: Callable[..., bool],
) -> None:
    cloud_settings = CloudSettings(
        data_dir=tmp_path / "cloud",
        database_url=f"sqlite:///{tmp_path / 'cloud.db'}",
        mqtt_url=broker.url,
        topic_prefix=topics.prefix,
        admin_token="test-admin-token",
        blob_fsync=False,
        rollout_tick_s=0,
    )
    announcer = MqttAnnouncer(MqttTarget.parse(broker.url), client_id="test-announcer")
    app = create_app(cloud_settings, announcer=announcer)
    state = app.state.edgeloop
    with state.sessions.begin() as session:
        token, _ = crud.create_enrollment_token(
            session=session, fleet="test-fleet", agent_id="agent-1", ttl_s=600
        )
        _, api_token = crud.enroll_agent(session=session, token=token, agent_id="agent-1")
        for version, seed in (("v2", 2), ("v3", 3)):
            path = make_tiny_student(
                tmp_path / f"{version}.onnx", size=32, seed=seed, version=version
            )
            registry.register_model(
                session=session, blobs=state.blobs, key=state.signing_key, artifact=path
            )
        # Announced while the agent is offline: retained, found on connect.
        registry.promote(
            session=session,
            announcer=announcer,
            topics=topics,
            fleet="test-fleet",
            name="tiny-student",
            version="v2",
            key=state.signing_key,
        )
    with ApiServer(app) as server:
        settings = make_settings(
            mqtt_url=broker.url,
            topic_prefix=topics.prefix,
            fleet_public_key=state.signing_key.public_key_b64,
            cloud_url=server.url,
            api_token=api_token,
            route_max_prob_below=None,
        )
        with Agent(settings, start_sources=False) as agent:
            assert until(lambda: agent.engine.version == "v2", timeout=30), agent.updater.status()
            failures: list[BaseException] = []
            versions: set[str] = set()
            stop = threading.Event()
            frames = [
                np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8)
                for i in range(8)
            ]

            def load() -> None:
                i = 0
                while not stop.is_set() and i < 20_000:
                    try:
                        versions.add(agent.process(frames[i % 8], source="test").model_version)
                    except BaseException as exc:
                        failures.append(exc)
                    i += 1

            threads = [threading.Thread(target=load) for _ in range(3)]
            for thread in threads:
                thread.start()
            try:
                with state.sessions.begin() as session:
                    registry.promote(
                        session=session,
                        announcer=announcer,
                        topics=topics,
                        fleet="test-fleet",
                        name="tiny-student",
                        version="v3",
                        key=state.signing_key,
                    )
                assert until(lambda: agent.engine.version == "v3", timeout=30)
                assert until(lambda: "v3" in versions, timeout=10)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(10)
            assert failures == []
            assert {"v2", "v3"} <= versions
            assert agent.updater.status()["history"][-1] == "v2"
    announcer.close()
