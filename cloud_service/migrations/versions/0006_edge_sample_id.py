"""Sample ids unique per agent: the id the agent gave a sample, beside the cloud's.

A sample whose id another agent's sample already holds is stored under a cloud id
derived from (fleet, agent, id); ``edge_sample_id`` keeps the agent's, which its
receipt and verdict carry. Existing rows get their own id.

Revision ID: 0006_edge_sample_id
Revises: 0005_distill_workers
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_edge_sample_id"
down_revision = "0005_distill_workers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("samples", sa.Column("edge_sample_id", sa.String(36), nullable=True))
    op.execute("UPDATE samples SET edge_sample_id = sample_id")


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("edge_sample_id")
