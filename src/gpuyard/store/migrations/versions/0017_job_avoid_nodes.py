"""Jobs: the nodes a job is not placed on again (where a straggler of it ran), null for none.

Revision ID: 0017_job_avoid_nodes
Revises: 0016_job_resize
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType

revision = "0017_job_avoid_nodes"
down_revision = "0016_job_resize"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("avoid_nodes", JSONType, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("avoid_nodes")
