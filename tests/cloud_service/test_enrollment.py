"""Enrollment tokens: one agent each, and a retry after a lost answer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cloud_service.db import crud, make_engine, make_session_factory, upgrade_database
from cloud_service.errors import AuthError, ConflictError


@pytest.fixture
def sessions(tmp_path: Path):  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'cloud.db'}"
    upgrade_database(url)
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def test_the_same_agent_may_retry_within_the_window(sessions) -> None:  # type: ignore[no-untyped-def]
    t0 = datetime.now(UTC)
    with sessions.begin() as session:
        token, _ = crud.create_enrollment_token(
            session=session, fleet="f", agent_id=None, ttl_s=60, now=t0
        )
        _, first = crud.enroll_agent(session=session, token=token, agent_id="cam-1", now=t0)
    # After the token's own expiry, but within the retry window: still the same agent.
    later = t0 + timedelta(seconds=crud.ENROLL_RETRY_S - 1)
    with sessions.begin() as session:
        agent, second = crud.enroll_agent(session=session, token=token, agent_id="cam-1", now=later)
        assert agent.agent_id == "cam-1" and second != first
        assert crud.agent_for_api_token(session=session, token=first) is None
    with sessions.begin() as session, pytest.raises(ConflictError, match="already used"):
        crud.enroll_agent(session=session, token=token, agent_id="cam-2", now=later)
    too_late = t0 + timedelta(seconds=crud.ENROLL_RETRY_S + 1)
    with sessions.begin() as session, pytest.raises(ConflictError, match="already used"):
        crud.enroll_agent(session=session, token=token, agent_id="cam-1", now=too_late)


def test_an_expired_unused_token_is_refused(sessions) -> None:  # type: ignore[no-untyped-def]
    t0 = datetime.now(UTC)
    with sessions.begin() as session:
        token, _ = crud.create_enrollment_token(
            session=session, fleet="f", agent_id=None, ttl_s=60, now=t0
        )
    with sessions.begin() as session, pytest.raises(AuthError, match="expired"):
        crud.enroll_agent(
            session=session, token=token, agent_id="cam-1", now=t0 + timedelta(seconds=61)
        )
