"""Fixtures for distill tests; the quick reference pair is in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from distill.cache import ReferenceConfig
from distill.frames import FrameSet
from distill.scenario import ScenarioConfig, render_split


@pytest.fixture(scope="session")
def quick_scenario() -> ScenarioConfig:
    return ReferenceConfig.reference(quick=True).scenario


@pytest.fixture(scope="session")
def quick_test_set(quick_scenario: ScenarioConfig) -> FrameSet:
    return render_split("test", quick_scenario)


@pytest.fixture(scope="session")
def small_test_set(quick_test_set: FrameSet) -> FrameSet:
    """A class-balanced sample of 120 test frames for cheap checks."""
    return quick_test_set.subset(slice(0, 120))


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated database on the test run's URL (SQLite or PostgreSQL)."""
    upgrade_database(database_url)
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)
