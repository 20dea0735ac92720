"""Review UI: users (admin, reviewer) and the review queue's index.

Revision ID: 0003_review_users
Revises: 0002_model_registry
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0003_review_users"
down_revision = "0002_model_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("username", sa.String(64), nullable=False, unique=True),
        sa.Column("password_hash", sa.String(256), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.Column("session_generation", sa.Integer(), nullable=False),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("last_login_at", UtcDateTime(), nullable=True),
    )
    # The queue filters on status and sorts by capture time (sample id breaks ties),
    # so one index serves the first page, deep pages and the next-sample lookup.
    op.create_index("ix_samples_status_captured", "samples", ["status", "captured_at", "sample_id"])


def downgrade() -> None:
    op.drop_index("ix_samples_status_captured", table_name="samples")
    op.drop_table("users")
