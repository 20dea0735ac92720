"""The job queue in the database: enqueue, claim, lease, progress, cancel, finish.

    job = enqueue(session=s, params={"min_samples": 200}, reason="run now")
    claimed = claim(session=s, owner="worker-1", lease_s=30)   # None when the queue is empty
    renew(session=s, job_id=claimed.id, owner="worker-1", lease_s=30, phase="train", percent=40)
    finish(session=s, job_id=claimed.id, owner="worker-1", state="succeeded", metrics={...})

Claims: on PostgreSQL ``SELECT ... FOR UPDATE SKIP LOCKED`` picks the next queued
row that no other transaction holds, so two workers never take one job; on SQLite
(one writer at a time anyway) the claim is a conditional ``UPDATE ... WHERE
state = 'queued'`` whose row count says whether this worker won.

Leases: a running job belongs to the worker named in ``lease_owner`` until
``lease_expires_at``; the worker's heartbeat (``renew``) pushes that forward. A
heartbeat that finds the lease gone (the job was requeued, or cancelled outright)
raises ``LeaseLost`` and the worker drops the job. ``reap_expired`` requeues the jobs
whose lease ran out, until their attempts reach ``max_attempts``, then fails them.

Every function takes the session and leaves committing to the caller, except
where noted; each runs in one short transaction in the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, union, update
from sqlalchemy.orm import Session

from cloud_service.db.models import Agent, EnrollmentToken
from cloud_service.errors import ConflictError, NotFoundError
from cloud_service.jobs.params import (
    JOB_PARAMETERS,
    JobParameter,
    job_parameter_docs,
    validate_params,
)
from cloud_service.jobs.tables import (
    JOB_STATES,
    TERMINAL_STATES,
    DistillJob,
    DistillWorkerRecord,
    JobLog,
)
from shared.errors import ContractError, EdgeLoopError, InvalidIdError
from shared.topics import validate_id

__all__ = [
    "JOB_PARAMETERS",
    "JobCancelled",
    "JobParameter",
    "LeaseLost",
    "QueueStatus",
    "append_log",
    "beat_worker",
    "cancel",
    "claim",
    "enqueue",
    "finish",
    "get_job",
    "job_parameter_docs",
    "known_fleets",
    "list_jobs",
    "live_workers",
    "queue_status",
    "read_logs",
    "reap_expired",
    "remove_worker",
    "renew",
    "resolve_fleet",
    "validate_params",
]

_MAX_LOG_CHARS = 4000


class LeaseLost(EdgeLoopError):
    """This worker no longer holds the job's lease (requeued, cancelled, or taken over)."""

    reason = "lease_lost"


class JobCancelled(EdgeLoopError):
    """Someone asked for the running job to stop; the job ends as cancelled."""

    reason = "cancelled"


def _now(now: datetime | None) -> datetime:
    return now or datetime.now(UTC)


def append_log(
    *, session: Session, job_id: int, message: str, level: str = "info", now: datetime | None = None
) -> None:
    session.add(JobLog(job_id=job_id, message=message[:_MAX_LOG_CHARS], level=level, at=_now(now)))


def enqueue(
    *,
    session: Session,
    params: Mapping[str, Any] | None = None,
    reason: str = "run now",
    priority: int = 5,
    max_attempts: int = 3,
    schedule_id: int | None = None,
    now: datetime | None = None,
) -> DistillJob:
    """Queue a job (parameters checked); returns the new row, flushed so it has an id."""
    if not 1 <= max_attempts <= 20:
        raise ContractError(f"max_attempts must be in [1, 20], got {max_attempts}")
    job = DistillJob(
        state="queued",
        params=validate_params(params or {}),
        priority=priority,
        max_attempts=max_attempts,
        schedule_id=schedule_id,
        reason=reason[:256],
        percent=0.0,
        metrics={},
        attempts=0,
        cancel_requested=False,
        created_at=_now(now),
    )
    session.add(job)
    session.flush()
    append_log(session=session, job_id=job.id, message=f"queued: {reason}", now=now)
    return job


def claim(
    *, session: Session, owner: str, lease_s: float, now: datetime | None = None
) -> DistillJob | None:
    """Take the next queued job for ``owner`` with a lease of ``lease_s``; None if none is free."""
    now = _now(now)
    lease_until = now + timedelta(seconds=lease_s)
    pick = (
        select(DistillJob.id)
        .where(DistillJob.state == "queued")
        .order_by(DistillJob.priority, DistillJob.id)
        .limit(1)
    )
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        # The row stays locked until this transaction commits; a second worker's
        # SKIP LOCKED passes over it to the next queued job.
        job_id = session.scalars(pick.with_for_update(skip_locked=True)).first()
        if job_id is None:
            return None
    else:
        job_id = session.scalars(pick).first()
        if job_id is None:
            return None
    # Conditional on still being queued: on SQLite this is the whole claim.
    result = session.execute(
        update(DistillJob)
        .where(DistillJob.id == job_id, DistillJob.state == "queued")
        .values(
            state="running",
            lease_owner=owner,
            lease_expires_at=lease_until,
            heartbeat_at=now,
            attempts=DistillJob.attempts + 1,
            started_at=now,
            phase="claimed",
            percent=0.0,
            eta_s=None,
            error=None,
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    job = session.get(DistillJob, job_id, populate_existing=True)
    assert job is not None
    append_log(
        session=session,
        job_id=job.id,
        message=f"claimed by {owner} (attempt {job.attempts} of {job.max_attempts})",
        now=now,
    )
    return job


def renew(
    *,
    session: Session,
    job_id: int,
    owner: str,
    lease_s: float,
    phase: str | None = None,
    percent: float | None = None,
    eta_s: float | None = None,
    now: datetime | None = None,
) -> bool:
    """Extend the lease and record progress; returns whether a cancel was asked for.

    Raises LeaseLost if ``owner`` no longer holds the running job.
    """
    now = _now(now)
    values: dict[str, Any] = {
        "lease_expires_at": now + timedelta(seconds=lease_s),
        "heartbeat_at": now,
    }
    if phase is not None:
        values["phase"] = phase[:32]
    if percent is not None:
        values["percent"] = float(max(0.0, min(100.0, percent)))
    if eta_s is not None:
        values["eta_s"] = float(eta_s)
    result = session.execute(
        update(DistillJob)
        .where(
            DistillJob.id == job_id,
            DistillJob.lease_owner == owner,
            DistillJob.state == "running",
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise LeaseLost(f"job {job_id} is no longer held by {owner}")
    cancel_requested = session.scalars(
        select(DistillJob.cancel_requested).where(DistillJob.id == job_id)
    ).first()
    return bool(cancel_requested)


def finish(
    *,
    session: Session,
    job_id: int,
    owner: str,
    state: str,
    metrics: Mapping[str, Any] | None = None,
    error: str | None = None,
    result_version: str | None = None,
    snapshot_id: int | None = None,
    now: datetime | None = None,
) -> None:
    """End a job this worker holds; raises LeaseLost if it no longer holds it."""
    if state not in TERMINAL_STATES:
        raise ContractError(f"a job finishes as one of {', '.join(TERMINAL_STATES)}, not {state!r}")
    now = _now(now)
    values: dict[str, Any] = {
        "state": state,
        "finished_at": now,
        "lease_owner": None,
        "lease_expires_at": None,
        "error": error,
        "eta_s": None,
    }
    if state == "succeeded":
        values["percent"] = 100.0
        values["phase"] = "done"
    if metrics is not None:
        values["metrics"] = dict(metrics)
    if result_version is not None:
        values["result_version"] = result_version
    if snapshot_id is not None:
        values["snapshot_id"] = snapshot_id
    result = session.execute(
        update(DistillJob)
        .where(
            DistillJob.id == job_id,
            DistillJob.lease_owner == owner,
            DistillJob.state == "running",
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise LeaseLost(f"job {job_id} is no longer held by {owner}")
    detail = f": {error}" if error else ""
    append_log(
        session=session,
        job_id=job_id,
        message=f"{state}{detail}",
        level="error" if state == "failed" else "info",
        now=now,
    )


def reap_expired(*, session: Session, now: datetime | None = None) -> list[int]:
    """Requeue running jobs whose lease ran out (or fail them when attempts are spent)."""
    now = _now(now)
    stmt = select(DistillJob).where(
        DistillJob.state == "running", DistillJob.lease_expires_at < now
    )
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    touched: list[int] = []
    for job in session.scalars(stmt).all():
        owner = job.lease_owner
        job.lease_owner = None
        job.lease_expires_at = None
        if job.cancel_requested:
            job.state, job.finished_at = "cancelled", now
            msg = f"lease of {owner} expired while a cancel was pending: cancelled"
        elif job.attempts < job.max_attempts:
            job.state, job.phase, job.percent = "queued", "retry", 0.0
            msg = (
                f"lease of {owner} expired (worker gone?): requeued,"
                f" attempt {job.attempts} of {job.max_attempts} used"
            )
        else:
            job.state, job.finished_at = "failed", now
            job.error = f"lease expired on its last attempt ({job.attempts} of {job.max_attempts})"
            msg = job.error
        append_log(session=session, job_id=job.id, message=msg, level="warning", now=now)
        touched.append(job.id)
    session.flush()
    return touched


def cancel(*, session: Session, job_id: int, now: datetime | None = None) -> DistillJob:
    """Cancel a job: a queued one at once; a running one when its worker next checks."""
    job = session.get(DistillJob, job_id, with_for_update=True)
    if job is None:
        raise NotFoundError(f"no job {job_id}")
    if job.state in TERMINAL_STATES:
        raise ConflictError(f"job {job_id} already {job.state}; nothing to cancel")
    if job.state == "queued":
        job.state, job.finished_at = "cancelled", _now(now)
        append_log(session=session, job_id=job_id, message="cancelled while queued", now=now)
    else:
        job.cancel_requested = True
        append_log(
            session=session,
            job_id=job_id,
            message="cancel requested; the worker stops at its next check",
            now=now,
        )
    session.flush()
    return job


def get_job(*, session: Session, job_id: int) -> DistillJob:
    job = session.get(DistillJob, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id}")
    return job


def list_jobs(
    *, session: Session, states: Sequence[str] | None = None, limit: int = 50
) -> list[DistillJob]:
    stmt = select(DistillJob).order_by(DistillJob.id.desc()).limit(limit)
    if states:
        bad = [s for s in states if s not in JOB_STATES]
        if bad:
            raise ContractError(f"unknown job state {bad[0]!r}; states: {', '.join(JOB_STATES)}")
        stmt = stmt.where(DistillJob.state.in_(list(states)))
    return list(session.scalars(stmt).all())


def read_logs(
    *, session: Session, job_id: int, after_id: int = 0, limit: int = 1000
) -> list[JobLog]:
    get_job(session=session, job_id=job_id)
    stmt = (
        select(JobLog)
        .where(JobLog.job_id == job_id, JobLog.id > after_id)
        .order_by(JobLog.id)
        .limit(limit)
    )
    return list(session.scalars(stmt).all())


# ---------------------------------------------------------------------------------
# Fleets


def known_fleets(*, session: Session) -> list[str]:
    """Fleets with an enrolled agent or an enrollment token, sorted."""
    stmt = union(select(Agent.fleet), select(EnrollmentToken.fleet))
    return sorted({str(f) for f in session.scalars(stmt).all()})


def resolve_fleet(*, session: Session, fleet: str | None) -> str:
    """The fleet a job or schedule is for: the one given, else the only known fleet."""
    if fleet is not None:
        try:
            return validate_id(fleet, "fleet")
        except InvalidIdError as exc:
            raise ContractError(exc.message) from exc
    fleets = known_fleets(session=session)
    if len(fleets) == 1:
        return fleets[0]
    if not fleets:
        raise ContractError(
            "no fleet is known yet (no enrolled agent, no enrollment token): name one with"
            ' --fleet (API: "fleet"), or enroll an agent first'
        )
    raise ContractError(
        f'{len(fleets)} fleets are known, say which with --fleet (API: "fleet"):'
        f" {', '.join(fleets)}"
    )


# ---------------------------------------------------------------------------------
# Workers: registered while they run, so a queue with nobody to take it is visible


def beat_worker(
    *,
    session: Session,
    owner: str,
    host: str,
    pid: int,
    ttl_s: float,
    job_id: int | None = None,
    now: datetime | None = None,
) -> None:
    """Register ``owner`` or renew its registration: alive until ``now + ttl_s``."""
    now = _now(now)
    row = session.get(DistillWorkerRecord, owner)
    if row is None:
        row = DistillWorkerRecord(owner=owner, host=host[:255], pid=pid, started_at=now)
        session.add(row)
    row.heartbeat_at, row.expires_at, row.job_id = now, now + timedelta(seconds=ttl_s), job_id
    session.flush()


def remove_worker(*, session: Session, owner: str) -> None:
    """A worker's clean stop: it no longer counts as live."""
    session.execute(delete(DistillWorkerRecord).where(DistillWorkerRecord.owner == owner))


def live_workers(*, session: Session, now: datetime | None = None) -> list[DistillWorkerRecord]:
    """Workers whose last beat has not expired, oldest first."""
    stmt = (
        select(DistillWorkerRecord)
        .where(DistillWorkerRecord.expires_at > _now(now))
        .order_by(DistillWorkerRecord.started_at)
    )
    return list(session.scalars(stmt).all())


@dataclass(frozen=True)
class QueueStatus:
    """What the queue holds and who is there to take it."""

    queued: int
    running: int
    live_workers: int
    oldest_queued_s: float | None

    @property
    def waiting_without_worker(self) -> int:
        """Queued jobs that no live worker will take (all of them, when none is live)."""
        return self.queued if self.live_workers == 0 else 0

    @property
    def warning(self) -> str | None:
        if not self.waiting_without_worker:
            return None
        jobs_word = "job waits" if self.queued == 1 else "jobs wait"
        return (
            f"{self.queued} {jobs_word} and no distill worker is running: start one with"
            " `cloud-service all` or `edgeloop jobs worker`"
        )


def queue_status(*, session: Session, now: datetime | None = None) -> QueueStatus:
    now = _now(now)
    counts = dict(
        session.execute(
            select(DistillJob.state, func.count())
            .where(DistillJob.state.in_(("queued", "running")))
            .group_by(DistillJob.state)
        ).all()
    )
    oldest = session.scalars(
        select(func.min(DistillJob.created_at)).where(DistillJob.state == "queued")
    ).first()
    workers = session.scalars(
        select(func.count())
        .select_from(DistillWorkerRecord)
        .where(DistillWorkerRecord.expires_at > now)
    ).one()
    return QueueStatus(
        queued=int(counts.get("queued", 0)),
        running=int(counts.get("running", 0)),
        live_workers=int(workers),
        oldest_queued_s=None if oldest is None else max(0.0, (now - oldest).total_seconds()),
    )
