"""Distillation jobs, their logs, schedules and dataset snapshots.

Revision ID: 0003_distill_jobs
Revises: 0002_model_registry
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0003_distill_jobs"
down_revision = "0002_model_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "distill_jobs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("schedule_id", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(256), nullable=True),
        sa.Column("phase", sa.String(32), nullable=True),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("eta_s", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", UtcDateTime(), nullable=True),
        sa.Column("heartbeat_at", UtcDateTime(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("result_version", sa.String(64), nullable=True),
        sa.Column("snapshot_id", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=True),
        sa.Column("finished_at", UtcDateTime(), nullable=True),
    )
    op.create_index("ix_distill_jobs_state_priority", "distill_jobs", ["state", "priority", "id"])
    op.create_index("ix_distill_jobs_schedule_id", "distill_jobs", ["schedule_id"])
    op.create_table(
        "job_logs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "job_id",
            sa.Integer(),
            sa.ForeignKey("distill_jobs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", UtcDateTime(), nullable=False),
        sa.Column("level", sa.String(8), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
    )
    op.create_index("ix_job_logs_job_id", "job_logs", ["job_id"])
    op.create_table(
        "schedules",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("expression", sa.String(256), nullable=False),
        sa.Column("trigger", sa.JSON(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("last_run_at", UtcDateTime(), nullable=True),
        sa.Column("next_run_at", UtcDateTime(), nullable=True),
        sa.Column("last_job_id", sa.Integer(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_table(
        "dataset_snapshots",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("train_ids", sa.JSON(), nullable=False),
        sa.Column("val_ids", sa.JSON(), nullable=False),
        sa.Column("holdout_ids", sa.JSON(), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=False),
    )
    op.create_index("ix_dataset_snapshots_job_id", "dataset_snapshots", ["job_id"])


def downgrade() -> None:
    op.drop_table("dataset_snapshots")
    op.drop_table("schedules")
    op.drop_index("ix_job_logs_job_id", table_name="job_logs")
    op.drop_table("job_logs")
    op.drop_index("ix_distill_jobs_schedule_id", table_name="distill_jobs")
    op.drop_index("ix_distill_jobs_state_priority", table_name="distill_jobs")
    op.drop_table("distill_jobs")
