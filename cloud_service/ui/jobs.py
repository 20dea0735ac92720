"""The jobs pages' seam onto distillation jobs and schedules.

Jobs go through ``distill.jobs`` (enqueue, cancel, get_job, list_jobs, read_logs)
and schedules through ``distill.schedules`` (create_schedule, list_schedules): the
distillation engineer's functions; the pages call only this module.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.orm import Session

__all__ = [
    "cancel_job",
    "create_schedule",
    "get_job",
    "job_view",
    "list_jobs",
    "list_schedules",
    "read_logs",
    "run_now",
]

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_CRON_FIELD = re.compile(r"^[0-9*/,\-]+$")


def run_now(
    *, session: Session, params: dict[str, Any], reason: str, schedule_id: int | None = None
) -> Any:
    from distill import jobs

    return jobs.enqueue(session=session, params=params, reason=reason, schedule_id=schedule_id)


def cancel_job(*, session: Session, job_id: int) -> Any:
    from distill import jobs

    return jobs.cancel(session=session, job_id=job_id)


def get_job(*, session: Session, job_id: int) -> Any:
    from distill import jobs

    return jobs.get_job(session=session, job_id=job_id)


def list_jobs(*, session: Session, limit: int = 50) -> list[Any]:
    from distill import jobs

    return list(jobs.list_jobs(session=session, limit=limit))


def read_logs(*, session: Session, job_id: int, after_id: int = 0) -> list[Any]:
    from distill import jobs

    return list(jobs.read_logs(session=session, job_id=job_id, after_id=after_id, limit=500))


def job_view(job: Any, logs: list[Any]) -> dict[str, Any]:
    """A job and its new log lines as the job page's script draws them."""
    return {
        "id": job.id,
        "state": job.state,
        "phase": job.phase,
        "percent": round(float(job.percent or 0.0), 1),
        "eta_s": job.eta_s,
        "cancel_requested": job.cancel_requested,
        "metrics": job.metrics or {},
        "error": job.error,
        "result_version": job.result_version,
        "logs": [
            {"id": line.id, "at": line.at.strftime("%H:%M:%S"), "level": line.level,
             "message": line.message}
            for line in logs
        ],
    }  # fmt: skip


def create_schedule(
    *, session: Session, name: str, kind: str, expression: str, params: dict[str, Any]
) -> Any:
    """Add a schedule: ``interval`` (seconds), ``cron`` (5 fields) or ``trigger``."""
    from distill import schedules

    return schedules.create_schedule(
        session=session, name=name, kind=kind, expression=expression, params=params
    )


def list_schedules(*, session: Session) -> list[Any]:
    from distill import schedules

    return list(schedules.list_schedules(session=session))
