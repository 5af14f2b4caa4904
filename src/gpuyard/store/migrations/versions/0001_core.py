"""Foundation: nodes and their inventory.

Revision ID: 0001_core
Revises:
Create Date: 2026-11-22

Each area adds its own migration with ``down_revision = "0001_core"`` (or a later revision of its
own); the store upgrades to every head, so areas do not have to be chained one after another.
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("hostname", sa.String(255), primary_key=True),
        sa.Column("inventory", JSONType, nullable=False),
        sa.Column("health", sa.String(16), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("nodes")
