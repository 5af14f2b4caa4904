"""Scheduler: a submission's idempotency key, so a retried POST /jobs returns the first job.

Revision ID: 0009_job_idempotency
Revises: 0007_scheduler_lease
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_job_idempotency"
down_revision = "0007_scheduler_lease"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("idempotency_key", sa.String(300), nullable=True))
    op.create_index("ix_jobs_idempotency_key", "jobs", ["idempotency_key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_idempotency_key", table_name="jobs")
    op.drop_column("jobs", "idempotency_key")
