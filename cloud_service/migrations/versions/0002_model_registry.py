"""Model registry and rollouts: model versions, fleet serving, per-agent overrides, history.

Revision ID: 0002_model_registry
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0002_model_registry"
down_revision = "0001"
branch_labels = None
depends_on = None

_BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("format", sa.String(8), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("artifact_key", sa.String(512), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("announcement", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("parent_version", sa.String(64), nullable=True),
        sa.Column("source", sa.String(256), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_index(
        "ux_model_versions_name_version", "model_versions", ["name", "version"], unique=True
    )
    op.create_table(
        "fleet_models",
        sa.Column("fleet", sa.String(64), primary_key=True),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
    )
    op.create_table(
        "agent_overrides",
        sa.Column("agent_id", sa.String(64), primary_key=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_index("ix_agent_overrides_fleet", "agent_overrides", ["fleet"])
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("baseline_version", sa.String(64), nullable=True),
        sa.Column("cohort", sa.JSON(), nullable=False),
        sa.Column("percent", sa.Float(), nullable=True),
        sa.Column("criteria", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("evaluation", sa.JSON(), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("window_ends_at", UtcDateTime(), nullable=False),
        sa.Column("finished_at", UtcDateTime(), nullable=True),
    )
    op.create_index("ix_rollouts_fleet", "rollouts", ["fleet"])
    op.create_table(
        "rollout_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "rollout_id",
            sa.Integer(),
            sa.ForeignKey("rollouts.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", UtcDateTime(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
    )
    op.create_index("ix_rollout_events_rollout_id", "rollout_events", ["rollout_id"])
    op.create_table(
        "model_status_events",
        sa.Column("id", _BIGINT, primary_key=True, autoincrement=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("model_version", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("at", UtcDateTime(), nullable=False),
    )
    op.create_index("ix_model_status_events_agent_at", "model_status_events", ["agent_id", "at"])


def downgrade() -> None:
    for table in (
        "model_status_events",
        "rollout_events",
        "rollouts",
        "agent_overrides",
        "fleet_models",
        "model_versions",
    ):
        op.drop_table(table)
