"""Runs: the team a run belongs to (studies, trials, folds and their artifacts with it); existing runs
go to team ``default``.

Revision ID: 0015_run_team
Revises: 0010_model_team
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_run_team"
down_revision = "0010_model_team"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server_default fills the column of every existing row: the backfill to team "default".
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("team", sa.String(100), nullable=False, server_default="default"))
        batch.create_index("ix_runs_team", ["team"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_team")
        batch.drop_column("team")
