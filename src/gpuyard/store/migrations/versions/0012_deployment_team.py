"""Serving: the team a deployment belongs to (its model's; existing deployments go to team ``default``).

Revision ID: 0012_deployment_team
Revises: 0008_serve_job
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_deployment_team"
down_revision = "0008_serve_job"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server_default fills the column of every existing row: the backfill to team "default" (the
    # team every model registered before 0010_model_team went to).
    with op.batch_alter_table("serve_deployments") as batch:
        batch.add_column(sa.Column("team", sa.String(100), nullable=False, server_default="default"))
        batch.create_index("ix_serve_deployments_team", ["team"])


def downgrade() -> None:
    with op.batch_alter_table("serve_deployments") as batch:
        batch.drop_index("ix_serve_deployments_team")
        batch.drop_column("team")
