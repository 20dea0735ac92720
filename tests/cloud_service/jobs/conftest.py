"""Fixtures for the job tests: a migrated database and its sessions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.db.session import make_engine, make_session_factory, upgrade_database


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
