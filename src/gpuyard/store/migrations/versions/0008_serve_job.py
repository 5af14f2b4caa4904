"""Serving: the scheduler job that holds a GPU deployment's replicas.

Revision ID: 0008_serve_job
Revises: 0005_serve
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_serve_job"
down_revision = "0005_serve"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign key to jobs.id: the jobs table lives on another branch of the chain, and a deployment
    # record outlives the job rows an operator may purge.
    op.add_column("serve_deployments", sa.Column("job_id", sa.Integer(), nullable=True))
    op.create_index("ix_serve_deployments_job_id", "serve_deployments", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_serve_deployments_job_id", table_name="serve_deployments")
    op.drop_column("serve_deployments", "job_id")
