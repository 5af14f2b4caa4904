"""Jobs: the size an elastic job was resized to (it restarts at that many GPUs), null otherwise.

Revision ID: 0016_job_resize
Revises: 0013_node_health
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_job_resize"
down_revision = "0013_node_health"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("resize_to", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resize_to")
