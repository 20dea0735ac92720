"""Initial cloud store: agents, enrollment tokens, samples, verdicts, labels, dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("agent_id", sa.String(64), primary_key=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_seen_at", UtcDateTime(), nullable=True),
        sa.Column("model_version", sa.String(128), nullable=True),
        sa.Column("telemetry", sa.JSON(), nullable=False),
        sa.Column("model_status", sa.JSON(), nullable=True),
        sa.Column("api_token_hash", sa.String(64), nullable=True, unique=True),
        sa.Column("enrolled_at", UtcDateTime(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_index("ix_agents_fleet", "agents", ["fleet"])
    op.create_table(
        "enrollment_tokens",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=True),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
        sa.Column("used_at", UtcDateTime(), nullable=True),
        sa.Column("used_by", sa.String(64), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_table(
        "samples",
        sa.Column("sample_id", sa.String(36), primary_key=True),
        sa.Column("fleet", sa.String(64), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("captured_at", UtcDateTime(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("model_version", sa.String(128), nullable=False),
        sa.Column("edge_scores", sa.JSON(), nullable=False),
        sa.Column("edge_predicted", sa.Integer(), nullable=False),
        sa.Column("edge_confidence", sa.Float(), nullable=False),
        sa.Column("route_reason", sa.String(32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("image_key", sa.String(512), nullable=False),
        sa.Column("image_format", sa.String(8), nullable=False),
        sa.Column("image_width", sa.Integer(), nullable=False),
        sa.Column("image_height", sa.Integer(), nullable=False),
        sa.Column("image_bytes", sa.Integer(), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("verified_at", UtcDateTime(), nullable=True),
    )
    op.create_index("ix_samples_fleet", "samples", ["fleet"])
    op.create_index("ix_samples_agent_captured", "samples", ["agent_id", "captured_at"])
    op.create_index("ix_samples_status_received", "samples", ["status", "received_at"])
    op.create_table(
        "verdicts",
        sa.Column("id", _BIGINT, primary_key=True, autoincrement=True),
        sa.Column(
            "sample_id",
            sa.String(36),
            sa.ForeignKey("samples.sample_id", ondelete="CASCADE"),
            nullable=False,
            unique=True,
        ),
        sa.Column("teacher_model", sa.String(128), nullable=False),
        sa.Column("teacher_version", sa.String(128), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=False),
        sa.Column("label", sa.Integer(), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("agrees_with_edge", sa.Boolean(), nullable=False),
        sa.Column("review", sa.Boolean(), nullable=False),
        sa.Column("review_reasons", sa.JSON(), nullable=False),
        sa.Column("verified_at", UtcDateTime(), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=True),
    )
    op.create_table(
        "labels",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "sample_id",
            sa.String(36),
            sa.ForeignKey("samples.sample_id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("label", sa.Integer(), nullable=False),
        sa.Column("labeled_by", sa.String(128), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
    )
    op.create_index("ix_labels_sample_id", "labels", ["sample_id"])
    op.create_table(
        "dead_letters",
        sa.Column("id", _BIGINT, primary_key=True, autoincrement=True),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("topic", sa.String(1024), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("fleet", sa.String(64), nullable=True),
        sa.Column("agent_id", sa.String(64), nullable=True),
        sa.Column("sample_id", sa.String(36), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("payload_size", sa.Integer(), nullable=False),
    )
    op.create_index("ix_dead_letters_received_at", "dead_letters", ["received_at"])
    op.create_index("ix_dead_letters_reason", "dead_letters", ["reason"])


def downgrade() -> None:
    for table in ("dead_letters", "labels", "verdicts", "samples", "enrollment_tokens", "agents"):
        op.drop_table(table)
