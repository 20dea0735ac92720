"""Model-announcement sequences: the last one each fleet used, so announcements only grow.

Revision ID: 0007_announcement_sequences
Revises: 0006_edge_sample_id
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cloud_service.db.models import UtcDateTime

revision = "0007_announcement_sequences"
down_revision = "0006_edge_sample_id"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "announcement_sequences",
        sa.Column("fleet", sa.String(64), primary_key=True),
        sa.Column("last_sequence", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("announcement_sequences")
