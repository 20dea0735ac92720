"""Test harness: real services, started once per session.

- ``broker``: the machine's Mosquitto at 127.0.0.1:1883 when it answers, else the
  embedded amqtt broker (a laptop without services still runs the suite).
- ``database_url``: each test gets a fresh database, on PostgreSQL at
  127.0.0.1:5432 when it answers and always on SQLite; tests that take it run on
  both. Set ``EDGELOOP_TEST_POSTGRES_URL`` to point elsewhere.
- ``mosquitto``: a private Mosquitto on a free port that a test may stop and
  start (outages, restarts), for tests that need to take the broker away.
- ``topics``: a topic namespace derived from the test's name, so tests sharing a
  broker never see each other's messages.
- ``own_switch_interval``: the process's switch interval set to 4 ms for the test
  (and put back after), so a test can tell a service's interval from the process's.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared.broker import EmbeddedBroker
from shared.broker import MosquittoProcess as SharedMosquitto
from shared.errors import TransportError
from shared.mqtt import MqttTarget, negotiate_protocol
from shared.topics import Topics

POSTGRES_ADMIN_URL = os.environ.get(
    "EDGELOOP_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
SYSTEM_BROKER = ("127.0.0.1", 1883)


def _answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class BrokerInfo:
    """A broker the tests can reach."""

    url: str
    kind: str  # "mosquitto" or "embedded"
    protocol: str  # "5" or "3.1.1"

    @property
    def target(self) -> MqttTarget:
        return MqttTarget.parse(self.url)

    @property
    def supports_shared_subscriptions(self) -> bool:
        return self.protocol == "5"


@pytest.fixture(scope="session")
def broker() -> Iterator[BrokerInfo]:
    """The machine's Mosquitto if it answers, else an embedded broker."""
    if _answers(*SYSTEM_BROKER):
        url = f"mqtt://{SYSTEM_BROKER[0]}:{SYSTEM_BROKER[1]}"
        yield BrokerInfo(url, "mosquitto", negotiate_protocol(MqttTarget.parse(url)))
        return
    with EmbeddedBroker() as embedded:
        yield BrokerInfo(embedded.url, "embedded", "3.1.1")


@pytest.fixture(scope="session")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """The embedded broker itself, for tests of the embedded mode."""
    with EmbeddedBroker() as embedded:
        yield embedded


def _slug(nodeid: str) -> str:
    name = re.sub(r"[^a-z0-9_-]+", "-", nodeid.split("::")[-1].lower()).strip("-")[:40] or "t"
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:8]
    return f"{name}-{digest}"


@pytest.fixture
def topics(request: pytest.FixtureRequest) -> Topics:
    """A topic namespace unique to this test (and this run)."""
    return Topics(prefix=f"edgeloop-test/{_slug(request.node.nodeid)}-{uuid.uuid4().hex[:6]}/v1")


# --- reference models ---------------------------------------------------------


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """Where the reference models tests share are cached, across runs.

    ``EDGELOOP_TEST_MODEL_CACHE``, else ``~/.cache/edgeloop/test-models``. An entry is
    keyed by everything it was made from (``distill.cache``) and written whole or not
    at all under a lock, so runs can share it; a fresh machine trains once.
    """
    configured = os.environ.get("EDGELOOP_TEST_MODEL_CACHE")
    path = Path(configured) if configured else Path.home() / ".cache" / "edgeloop" / "test-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def quick_models(model_cache: Path) -> Any:
    """The quick reference teacher/student (about 20 s to train on two cores), once."""
    from distill.cache import bootstrap_reference_models

    return bootstrap_reference_models(model_cache, quick=True)


@pytest.fixture(scope="session")
def quick_detectors(model_cache: Path) -> Any:
    """The quick reference detector pair (``distill.detector_cache``), once."""
    from distill.detector_cache import bootstrap_reference_detectors

    return bootstrap_reference_detectors(model_cache, quick=True)


@pytest.fixture(scope="session")
def quick_scenario() -> Any:
    """The quick reference scenario (``distill.scenario.ScenarioConfig``) of ``quick_models``."""
    from distill.cache import ReferenceConfig

    return ReferenceConfig.reference(quick=True).scenario


# --- databases ---------------------------------------------------------------


def _postgres_available() -> bool:
    from sqlalchemy.engine import make_url

    url = make_url(POSTGRES_ADMIN_URL)
    return _answers(url.host or "127.0.0.1", url.port or 5432)


def _fresh_postgres_database(test_name: str) -> Iterator[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"edgeloop_{_slug(test_name).replace('-', '_')}_{uuid.uuid4().hex[:6]}"[:63]
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: SQLite always, PostgreSQL when it answers."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'edgeloop.db'}"
        return
    if not _postgres_available():
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}; SQLite covers this test")
    yield from _fresh_postgres_database(request.node.nodeid)


# --- a private Mosquitto, for outages ---------------------------------------


class MosquittoProcess(SharedMosquitto):
    """``shared.broker.MosquittoProcess``; the test skips where Mosquitto is missing."""

    def __init__(self, workdir: Path, extra_config: str = "") -> None:
        try:
            super().__init__(workdir, extra_config=extra_config)
        except TransportError as exc:
            pytest.skip(f"{exc}; make test installs it when run as root")


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[MosquittoProcess]:
    """A private, running Mosquitto that the test may stop and start again."""
    process = MosquittoProcess(tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def own_switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield 0.004
    sys.setswitchinterval(before)
