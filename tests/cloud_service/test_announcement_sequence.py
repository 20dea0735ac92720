"""Announcement sequences only grow: across replicas, restarts, a clock going back; refresh."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine

from cloud_service import registry
from cloud_service.announce import MemoryAnnouncer
from cloud_service.blobs import LocalBlobStore
from cloud_service.db.models import FleetModel
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from edge_agent.testing import make_tiny_student
from shared.manifest import FleetSigningKey
from shared.messages import verify_manifest_bytes
from shared.topics import Topics


@pytest.fixture
def engines(database_url: str) -> Iterator[tuple[Engine, Engine]]:
    """Two engines on one database: two API replicas."""
    upgrade_database(database_url)
    first, second = make_engine(database_url), make_engine(database_url)
    yield first, second
    first.dispose()
    second.dispose()


def _next(engine: Engine, fleet: str = "plant-3", now: datetime | None = None) -> int:
    with make_session_factory(engine).begin() as session:
        return registry.next_sequence(session=session, fleet=fleet, now=now)


def test_replicas_and_a_clock_going_back_still_give_increasing_sequences(
    engines: tuple[Engine, Engine],
) -> None:
    a, b = engines
    now = datetime.now(UTC)
    seen = [_next(a, now=now), _next(b, now=now), _next(a, now=now - timedelta(days=1))]
    seen.append(_next(b, now=now - timedelta(days=365)))  # a replica with a wrong clock
    assert seen == sorted(set(seen)), seen
    assert seen[0] >= int(now.timestamp() * 1000)  # carried on by the wall clock
    assert _next(a, fleet="other", now=now) < seen[-1]  # each fleet has its own row


def test_concurrent_replicas_never_share_a_sequence(engines: tuple[Engine, Engine]) -> None:
    got: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    now = datetime.now(UTC)

    def allocate(engine: Engine) -> None:
        try:
            for _ in range(10):
                value = _next(engine, now=now)
                with lock:
                    got.append(value)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=allocate, args=(e,)) for e in (*engines, *engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(got) == 40 and len(set(got)) == 40


def test_a_sequence_survives_a_restart(database_url: str) -> None:
    upgrade_database(database_url)
    engine = make_engine(database_url)
    first = _next(engine, now=datetime.now(UTC) + timedelta(days=1))  # well ahead of the clock
    engine.dispose()
    restarted = make_engine(database_url)
    assert _next(restarted) == first + 1
    restarted.dispose()


def test_refresh_signs_again_only_what_is_past_half_its_lifetime(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cloud.db'}"
    upgrade_database(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    blobs = LocalBlobStore(tmp_path / "blobs", fsync=False)
    key, announcer, topics = FleetSigningKey.generate(), MemoryAnnouncer(), Topics()
    with sessions.begin() as session:
        path = make_tiny_student(tmp_path / "v2.onnx", size=32, seed=2, version="v2")
        record = registry.register_model(session=session, blobs=blobs, key=key, artifact=path)
        for fleet in ("idle", "busy"):
            registry.promote(
                session=session,
                announcer=announcer,
                topics=topics,
                fleet=fleet,
                name=record.name,
                version=record.version,
                key=key,
            )
        idle = session.get(FleetModel, "idle")
        assert idle is not None
        idle.updated_at = datetime.now(UTC) - timedelta(days=16)
    before = verify_manifest_bytes(
        announcer.retained[topics.fleet_models("idle")], key.public_key_b64
    )
    with sessions.begin() as session:
        refreshed = registry.refresh_announcements(
            session=session, announcer=announcer, topics=topics, key=key
        )
    assert refreshed == [topics.fleet_models("idle")]
    after = verify_manifest_bytes(
        announcer.retained[topics.fleet_models("idle")], key.public_key_b64
    )
    assert after.version == "v2" and after.fleet == "idle"
    assert before.sequence is not None and after.sequence is not None
    assert after.sequence > before.sequence
    assert before.expires_at is not None and after.expires_at is not None
    assert after.expires_at > before.expires_at
    engine.dispose()
