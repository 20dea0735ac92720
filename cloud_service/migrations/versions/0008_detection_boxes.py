"""Detection: the boxes of the edge's answer, the teacher's verdict and a human's label.

NULL on every row of a classifier's sample, so existing rows need nothing.

Revision ID: 0008_detection_boxes
Revises: 0007_announcement_sequences
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_detection_boxes"
down_revision = "0007_announcement_sequences"
branch_labels = None
depends_on = None

_COLUMNS = (("samples", "edge_boxes"), ("verdicts", "boxes"), ("labels", "boxes"))


def upgrade() -> None:
    for table, column in _COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column(column, sa.JSON(), nullable=True))


def downgrade() -> None:
    for table, column in reversed(_COLUMNS):
        with op.batch_alter_table(table) as batch:
            batch.drop_column(column)
