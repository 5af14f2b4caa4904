"""Datasets: the team a dataset belongs to (existing datasets go to team ``default``).

Revision ID: 0011_dataset_team
Revises: 0002_data
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_dataset_team"
down_revision = "0002_data"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server_default fills the column of every existing row: the backfill to team "default".
    with op.batch_alter_table("datasets") as batch:
        batch.add_column(sa.Column("team", sa.String(100), nullable=False, server_default="default"))
        batch.create_index("ix_datasets_team", ["team"])


def downgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.drop_index("ix_datasets_team")
        batch.drop_column("team")
