"""Models: the team a registered model belongs to (existing models go to team ``default``).

Revision ID: 0010_model_team
Revises: 0004_models
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_model_team"
down_revision = "0004_models"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # server_default fills the column of every existing row: the backfill to team "default".
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("team", sa.String(100), nullable=False, server_default="default"))
        batch.create_index("ix_model_versions_team", ["team"])


def downgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_index("ix_model_versions_team")
        batch.drop_column("team")
