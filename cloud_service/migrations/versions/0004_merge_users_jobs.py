"""Join the review-users and distill-jobs branches into one history.

Revision ID: 0004_merge_users_jobs
Revises: 0003_review_users, 0003_distill_jobs
"""

from __future__ import annotations

revision = "0004_merge_users_jobs"
down_revision = ("0003_review_users", "0003_distill_jobs")
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Nothing to change: the two branches touch different tables."""


def downgrade() -> None:
    """Nothing to change."""
