"""Distillation jobs and schedules over REST (admin token).

``/v1/jobs``: list, create (run now, for a fleet), show, cancel, logs; the queue's state
(``/v1/jobs/queue``: does anything wait with no worker?) and the parameters a job takes
(``/v1/jobs/params``); ``/v1/fleets``, the known fleets. ``/v1/schedules``: list,
create, show, update (enable/disable), delete, run now. Each route checks its input,
calls one function of ``cloud_service.jobs.queue`` / ``cloud_service.jobs.schedules``,
and returns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from cloud_service.api.schemas import MAX_ROW_ID, RowIdPath
from cloud_service.jobs import queue as jobs
from cloud_service.jobs import schedules
from cloud_service.jobs.tables import JOB_STATES
from cloud_service.web.deps import AdminDep, SessionDep
from cloud_service.web.state import ApiState
from shared.errors import ContractError

router = APIRouter(prefix="/v1", tags=["jobs"])

# How often the API process queues due schedules (several replicas fire each once).
SCHEDULER_TICK_S = 15.0


FleetField = Field(
    default=None,
    max_length=64,
    description="the fleet the job trains for; default: the only known fleet (enrolled agents"
    " or tokens), refused when there are several or none",
)


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fleet: str | None = FleetField
    params: dict[str, Any] = Field(
        default_factory=dict, description="job parameters: GET /v1/jobs/params lists them"
    )
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
    fleet: str | None = FleetField
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


class QueueOut(BaseModel):
    queued: int
    running: int
    live_workers: int
    waiting_without_worker: int
    oldest_queued_s: float | None
    warning: str | None


class ParamOut(BaseModel):
    name: str
    type: str
    default: Any
    range: str | None
    meaning: str


def with_fleet(session: Session, fleet: str | None, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the fleet resolved (the field, else ``params.fleet``, else the only
    known fleet); a ContractError (422) names the choices."""
    given = params.get("fleet")
    if fleet is not None and given is not None and given != fleet:
        raise ContractError(f"fleet {fleet!r} and params.fleet {given!r} disagree; give one")
    return {**params, "fleet": jobs.resolve_fleet(session=session, fleet=fleet or given)}


def watch_queue(state: ApiState) -> None:
    """Export the queue's figures on ``/metrics`` (read from the database at each scrape)."""

    def figures() -> dict[str, float]:
        with state.sessions() as session:
            q = jobs.queue_status(session=session)
        return {
            "queued": q.queued,
            "running": q.running,
            "live_workers": q.live_workers,
            "waiting_without_worker": q.waiting_without_worker,
            "oldest_queued_s": q.oldest_queued_s or 0.0,
        }

    state.metrics.watch_distill_queue(figures)


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


@router.get("/jobs/queue", response_model=QueueOut)
def queue(session: SessionDep, _: AdminDep) -> Any:
    """Queued and running jobs, live distill workers, and whether jobs wait with none."""
    q = jobs.queue_status(session=session)
    return QueueOut(
        queued=q.queued,
        running=q.running,
        live_workers=q.live_workers,
        waiting_without_worker=q.waiting_without_worker,
        oldest_queued_s=q.oldest_queued_s,
        warning=q.warning,
    )


@router.get("/jobs/params", response_model=list[ParamOut])
def job_params(_: AdminDep) -> Any:
    """The parameters a job takes: name, type, default, range, meaning."""
    return jobs.job_parameter_docs()


@router.get("/fleets", response_model=list[str])
def fleets(session: SessionDep, _: AdminDep) -> Any:
    """The known fleets: those with an enrolled agent or an enrollment token."""
    return jobs.known_fleets(session=session)


@router.post("/jobs", response_model=JobDetail, status_code=status.HTTP_201_CREATED)
def create_job(body: JobIn, session: SessionDep, _: AdminDep) -> Any:
    return jobs.enqueue(
        session=session,
        params=with_fleet(session, body.fleet, body.params),
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
        params=with_fleet(session, body.fleet, body.params),
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
