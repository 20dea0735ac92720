"""The job queue: claims, leases, retries, cancel, wall time; on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from cloud_service.db.session import make_engine, make_session_factory
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.worker import DistillWorker, JobContext, JobOutcome
from shared.errors import ContractError

pytestmark = pytest.mark.sql
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _enqueue(sessions: sessionmaker[Session], n: int = 1, **kwargs: object) -> list[int]:
    with sessions.begin() as s:
        return [jobs.enqueue(session=s, **kwargs).id for _ in range(n)]  # type: ignore[arg-type]


def _state(sessions: sessionmaker[Session], job_id: int) -> str:
    with sessions() as s:
        return jobs.get_job(session=s, job_id=job_id).state


def test_two_workers_never_run_one_job(database_url: str, sessions: sessionmaker[Session]) -> None:
    ids = _enqueue(sessions, 8)
    ran: list[tuple[str, int]] = []
    lock = threading.Lock()

    def runner(ctx: JobContext) -> JobOutcome:
        with lock:
            ran.append((ctx.owner, ctx.job_id))
        time.sleep(0.05)
        return JobOutcome(metrics={"ok": 1})

    workers = []
    engines = []
    for name in ("w1", "w2"):
        eng = make_engine(database_url)  # each worker its own pool, as separate processes have
        engines.append(eng)
        workers.append(
            DistillWorker(make_session_factory(eng), runner=runner, owner=name, poll_s=0.02)
        )
    threads = [threading.Thread(target=w.run, kwargs={"idle_exit_s": 0.5}) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for eng in engines:
        eng.dispose()
    counts = Counter(job_id for _, job_id in ran)
    assert sorted(counts) == ids and set(counts.values()) == {1}
    assert all(_state(sessions, i) == "succeeded" for i in ids)


def test_postgres_claim_skips_a_locked_job(database_url: str, engine: Engine) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("SKIP LOCKED is PostgreSQL's; SQLite runs one worker")
    sessions = make_session_factory(engine)
    first, second = _enqueue(sessions, 2)
    a, b = sessions(), sessions()
    try:
        got_a = jobs.claim(session=a, owner="a", lease_s=30)  # transaction open: row locked
        got_b = jobs.claim(session=b, owner="b", lease_s=30)  # must not wait, must skip
        assert got_a is not None and got_b is not None
        assert (got_a.id, got_b.id) == (first, second)
        a.commit()
        b.commit()
        assert jobs.claim(session=a, owner="a", lease_s=30) is None
    finally:
        a.close()
        b.close()


def test_killed_workers_job_is_retried(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions)
    claimed_at = datetime.now(UTC) - timedelta(minutes=5)
    with sessions.begin() as s:  # a worker claimed it, then died: no heartbeat ever came
        assert jobs.claim(session=s, owner="dead-worker", lease_s=30, now=claimed_at) is not None

    worker = DistillWorker(sessions, runner=lambda ctx: JobOutcome(metrics={"a": ctx.attempt}))
    assert worker.run_once() == job_id
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert (job.state, job.attempts, job.metrics) == ("succeeded", 2, {"a": 2})
        logs = " | ".join(line.message for line in jobs.read_logs(session=s, job_id=job_id))
    assert "lease of dead-worker expired" in logs


def test_retries_are_bounded(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions, max_attempts=2)
    for attempt in range(2):
        claimed_at = T0 + timedelta(minutes=attempt)
        with sessions.begin() as s:
            assert jobs.claim(session=s, owner="flaky", lease_s=5, now=claimed_at) is not None
        with sessions.begin() as s:
            jobs.reap_expired(session=s, now=claimed_at + timedelta(seconds=6))
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "failed" and job.attempts == 2
        assert "last attempt" in (job.error or "")
    with sessions.begin() as s:
        assert (
            jobs.claim(session=s, owner="other", lease_s=5, now=T0 + timedelta(minutes=2)) is None
        )


def _slow_runner(ctx: JobContext) -> JobOutcome:
    for step in range(2000):  # about 20 s unless stopped
        ctx.progress("train", step / 20)
        time.sleep(0.01)
    return JobOutcome()


def test_cancel_stops_a_running_job(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions)
    worker = DistillWorker(sessions, runner=_slow_runner, lease_s=0.6, poll_s=0.02)
    thread = threading.Thread(target=worker.run_once)
    thread.start()
    deadline = time.monotonic() + 10
    while _state(sessions, job_id) != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    started = time.monotonic()
    with sessions.begin() as s:
        jobs.cancel(session=s, job_id=job_id)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3.0
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "cancelled" and job.lease_owner is None
        assert job.percent > 0  # progress reached the database through the heartbeat


def test_cancel_a_queued_job_and_not_a_finished_one(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions)
    with sessions.begin() as s:
        assert jobs.cancel(session=s, job_id=job_id).state == "cancelled"
    with sessions.begin() as s, pytest.raises(ContractError, match="already cancelled"):
        jobs.cancel(session=s, job_id=job_id)


def test_wall_time_limit_fails_the_job(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions, params={"wall_time_s": 1.0})
    worker = DistillWorker(sessions, runner=_slow_runner, lease_s=2.0)
    started = time.monotonic()
    worker.run_once()
    assert time.monotonic() - started < 5
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "failed" and "wall-time" in (job.error or "")


def test_a_failing_job_records_its_error(sessions: sessionmaker[Session]) -> None:
    (job_id,) = _enqueue(sessions)

    def boom(ctx: JobContext) -> JobOutcome:
        raise RuntimeError("no verified samples")

    DistillWorker(sessions, runner=boom).run_once()
    with sessions() as s:
        job = jobs.get_job(session=s, job_id=job_id)
        assert job.state == "failed" and "no verified samples" in (job.error or "")


def test_bad_parameters_get_a_clear_error(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        with pytest.raises(ContractError, match="unknown job parameter 'epoch'"):
            jobs.enqueue(session=s, params={"epoch": 3})
        with pytest.raises(ContractError, match=r"'threads' must be in \[1, 256\]"):
            jobs.enqueue(session=s, params={"threads": 0})
        with pytest.raises(ContractError, match=r"'candidates' must be in \[1, 8\]"):
            jobs.enqueue(session=s, params={"candidates": 9})
        with pytest.raises(ContractError, match="delivery must be one of"):
            jobs.enqueue(session=s, params={"delivery": "ship-it"})
