"""Distillation jobs and schedules over REST (admin token).

``/v1/jobs``: list, create (run now), show, cancel, logs. ``/v1/schedules``: list,
create, show, update (enable/disable), delete, run now. Each route checks its input,
calls one function of ``distill.jobs`` / ``distill.schedules``, and returns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, ConfigDict, Field

from cloud_service.api.deps import AdminDep, SessionDep
from cloud_service.api.schemas import MAX_ROW_ID, RowIdPath
from distill import jobs, schedules
from distill.store import JOB_STATES

router = APIRouter(prefix="/v1", tags=["jobs"])

# How often the API process queues due schedules (several replicas fire each once).
SCHEDULER_TICK_S = 15.0


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)
    reason: str = Field(default="run now (API)", max_length=256)
    priority: int = Field(default=5, ge=0, le=9)
    max_attempts: int = Field(default=3, ge=1, le=20)


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    state: str
    params: dict[str, Any]
    priority: int
    schedule_id: int | None
    reason: str | None
    phase: str | None
    percent: float
    eta_s: float | None
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    result_version: str | None
    snapshot_id: int | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobDetail(JobOut):
    metrics: dict[str, Any]


class LogOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    level: str
    message: str


class ScheduleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    kind: str = Field(description="cron | interval | trigger")
    expression: str = Field(
        max_length=256,
        description="cron: five fields; interval: seconds; trigger: new_samples | drift",
    )
    trigger: dict[str, Any] = Field(default_factory=dict)
    params: dict[str, Any] = Field(default_factory=dict)
    enabled: bool = True


class ScheduleUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool


class ScheduleOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    kind: str
    expression: str
    trigger: dict[str, Any]
    params: dict[str, Any]
    enabled: bool
    last_run_at: datetime | None
    next_run_at: datetime | None
    last_job_id: int | None
    created_at: datetime


StateQuery = Annotated[
    list[str] | None, Query(description=f"filter by state: {', '.join(JOB_STATES)}")
]


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(
    session: SessionDep,
    _: AdminDep,
    state: StateQuery = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> Any:
    return jobs.list_jobs(session=session, states=state, limit=limit)


@router.post("/jobs", response_model=JobDetail, status_code=status.HTTP_201_CREATED)
def create_job(body: JobIn, session: SessionDep, _: AdminDep) -> Any:
    return jobs.enqueue(
        session=session,
        params=body.params,
        reason=body.reason,
        priority=body.priority,
        max_attempts=body.max_attempts,
    )


@router.get("/jobs/{job_id}", response_model=JobDetail)
def show_job(job_id: RowIdPath, session: SessionDep, _: AdminDep) -> Any:
    return jobs.get_job(session=session, job_id=job_id)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: RowIdPath, session: SessionDep, _: AdminDep) -> Any:
    return jobs.cancel(session=session, job_id=job_id)


@router.get("/jobs/{job_id}/logs", response_model=list[LogOut])
def job_logs(
    job_id: RowIdPath,
    session: SessionDep,
    _: AdminDep,
    after: Annotated[int, Query(ge=0, le=MAX_ROW_ID, description="only lines after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Any:
    return jobs.read_logs(session=session, job_id=job_id, after_id=after, limit=limit)


@router.get("/schedules", response_model=list[ScheduleOut])
def list_schedules(session: SessionDep, _: AdminDep) -> Any:
    return schedules.list_schedules(session=session)


@router.post("/schedules", response_model=ScheduleOut, status_code=status.HTTP_201_CREATED)
def create_schedule(body: ScheduleIn, session: SessionDep, _: AdminDep) -> Any:
    return schedules.create_schedule(
        session=session,
        name=body.name,
        kind=body.kind,
        expression=body.expression,
        trigger=body.trigger,
        params=body.params,
        enabled=body.enabled,
    )


@router.get("/schedules/{schedule_id}", response_model=ScheduleOut)
def show_schedule(schedule_id: RowIdPath, session: SessionDep, _: AdminDep) -> Any:
    return schedules.get_schedule(session=session, schedule_id=schedule_id)


@router.patch("/schedules/{schedule_id}", response_model=ScheduleOut)
def update_schedule(
    schedule_id: RowIdPath, body: ScheduleUpdate, session: SessionDep, _: AdminDep
) -> Any:
    return schedules.set_enabled(session=session, schedule_id=schedule_id, enabled=body.enabled)


@router.delete("/schedules/{schedule_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_schedule(schedule_id: RowIdPath, session: SessionDep, _: AdminDep) -> None:
    schedules.delete_schedule(session=session, schedule_id=schedule_id)


@router.post("/schedules/{schedule_id}/run", response_model=JobDetail, status_code=201)
def run_schedule_now(schedule_id: RowIdPath, session: SessionDep, _: AdminDep) -> Any:
    return schedules.run_now(session=session, schedule_id=schedule_id)
