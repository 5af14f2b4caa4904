"""Scheduler: jobs and job events.

Revision ID: 0003_jobs
Revises: 0001_core
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0003_jobs"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("team", sa.String(100), nullable=False),
        sa.Column("user", sa.String(100), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("spec", JSONType, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("placement", JSONType, nullable=True),
        sa.Column("handle", JSONType, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("attained_s", sa.Float(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("stop_requested", sa.String(16), nullable=True),
        sa.Column("stop_deadline", UTCDateTime(), nullable=True),
        sa.Column("killed", sa.Boolean(), nullable=False),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("submitted_at", UTCDateTime(), nullable=False),
        sa.Column("queued_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_team", "jobs", ["team"])
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("data", JSONType, nullable=True),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_events_job_id", "job_events")
    op.drop_table("job_events")
    op.drop_index("ix_jobs_team", "jobs")
    op.drop_index("ix_jobs_state", "jobs")
    op.drop_table("jobs")
