"""Scheduler: the lease that makes one job service the only scheduler of a store.

Revision ID: 0007_scheduler_lease
Revises: 0003_jobs
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import UTCDateTime

revision = "0007_scheduler_lease"
down_revision = "0003_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "scheduler_lease",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("pid_started", sa.Float(), nullable=False),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("acquired_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("scheduler_lease")
