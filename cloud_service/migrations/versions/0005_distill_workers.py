"""Distill workers that are running, so a job waiting with none is reported as such.

Revision ID: 0005_distill_workers
Revises: 0004_merge_users_jobs
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0005_distill_workers"
down_revision = "0004_merge_users_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "distill_workers",
        sa.Column("owner", sa.String(128), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("heartbeat_at", UtcDateTime(), nullable=False),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
    )
    op.create_index("ix_distill_workers_expires_at", "distill_workers", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_distill_workers_expires_at", table_name="distill_workers")
    op.drop_table("distill_workers")
