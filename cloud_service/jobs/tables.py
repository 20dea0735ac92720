"""The job tables: distillation jobs, their logs, workers, schedules and dataset snapshots.

They share the cloud store's ``Base`` (one metadata) and are created by the
migrations ``0003_distill_jobs`` and ``0005_distill_workers``. A job moves through::

    queued -> running -> succeeded | failed | cancelled
       ^         |
       +---------+  lease expired (the worker died) and attempts < max_attempts

A running job is held by one worker's lease (``lease_owner``, ``lease_expires_at``),
renewed by that worker's heartbeat; a lease that runs out puts the job back in the
queue (or fails it once its attempts are spent).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from cloud_service.db.models import Base, utcnow

__all__ = [
    "JOB_STATES",
    "SCHEDULE_KINDS",
    "TERMINAL_STATES",
    "DatasetSnapshot",
    "DistillJob",
    "DistillWorkerRecord",
    "JobLog",
    "Schedule",
]

JOB_STATES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES: tuple[str, ...] = ("succeeded", "failed", "cancelled")
SCHEDULE_KINDS: tuple[str, ...] = ("cron", "interval", "trigger")


class DistillJob(Base):
    """One distillation job: parameters in, progress while it runs, metrics out."""

    __tablename__ = "distill_jobs"
    __table_args__ = (Index("ix_distill_jobs_state_priority", "state", "priority", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    priority: Mapped[int] = mapped_column(Integer, default=5)  # lower runs first
    schedule_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    reason: Mapped[str | None] = mapped_column(String(256), nullable=True)  # why it was queued
    phase: Mapped[str | None] = mapped_column(String(32), nullable=True)
    percent: Mapped[float] = mapped_column(Float, default=0.0)
    eta_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    result_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    snapshot_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class DistillWorkerRecord(Base):
    """A distill worker that is running: it registers at start, beats while it lives and
    removes itself at a clean stop; past ``expires_at`` without a beat it counts as gone."""

    __tablename__ = "distill_workers"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class JobLog(Base):
    """One line of a job's log (appended by the worker as the job runs)."""

    __tablename__ = "job_logs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("distill_jobs.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(8), default="info")
    message: Mapped[str] = mapped_column(Text)


class Schedule(Base):
    """When to queue a job: a cron expression, an interval, or a data trigger."""

    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # cron | interval | trigger
    expression: Mapped[str] = mapped_column(String(256))  # cron text, seconds, trigger kind
    trigger: Mapped[dict[str, Any]] = mapped_column(default=dict)  # trigger conditions
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the jobs' parameters
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    last_run_at: Mapped[datetime | None] = mapped_column(nullable=True)
    next_run_at: Mapped[datetime | None] = mapped_column(nullable=True)
    last_job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DatasetSnapshot(Base):
    """The exact samples a job trained and was judged on (lineage of a model version)."""

    __tablename__ = "dataset_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    train_ids: Mapped[list[Any]] = mapped_column(default=list)
    val_ids: Mapped[list[Any]] = mapped_column(default=list)
    holdout_ids: Mapped[list[Any]] = mapped_column(default=list)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
