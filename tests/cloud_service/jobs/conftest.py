"""Fixtures for the job tests: a migrated database and its sessions; helpers that store
frames and run one queued job."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service import registry
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.runner import make_runner
from cloud_service.jobs.worker import DistillWorker


def png_bytes(frame: np.ndarray) -> bytes:
    """A frame as the PNG bytes a sample's blob holds."""
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


def run_one_job(setup: dict[str, Any], params: dict[str, Any]) -> int:
    """Queue a job with ``params`` and let one worker run it (``setup`` holds the
    ``sessions`` and the ``services``); the job's id."""
    sessions = setup["sessions"]
    with sessions.begin() as s:
        job_id = jobs.enqueue(session=s, params=params, reason="test").id
    worker = DistillWorker(sessions, runner=make_runner(setup["services"]), lease_s=10)
    assert worker.run_once() == job_id
    return int(job_id)


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


def serve_model(
    sessions: sessionmaker[Session], *, artifact: Any, name: str, fleet: str, **services: Any
) -> None:
    """Register ``artifact`` as ``name`` version "ref" (INT8) and promote it to ``fleet``;
    ``services`` are the registry's: ``blobs``, ``key``, ``announcer``, ``topics``."""
    blobs, key = services["blobs"], services["key"]
    with sessions.begin() as s:
        registry.register_model(
            session=s,
            blobs=blobs,
            key=key,
            artifact=artifact,
            name=name,
            version="ref",
            format="int8",
        )
        registry.promote(
            session=s, announcer=services["announcer"], topics=services["topics"],
            fleet=fleet, name=name, version="ref", key=key,
        )  # fmt: skip
