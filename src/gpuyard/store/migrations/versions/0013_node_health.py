"""Scheduler: node health states (healthy / degraded / drained) and their history.

Revision ID: 0013_node_health
Revises: 0009_job_idempotency
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0013_node_health"
down_revision = "0009_job_idempotency"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign key to nodes.hostname: the scheduler's nodes (Ray workers, fabric clusters) need not
    # have an inventory row. A node without a row is healthy.
    op.create_table(
        "node_states",
        sa.Column("hostname", sa.String(255), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("by", sa.String(100), nullable=True),
        sa.Column("since", UTCDateTime(), nullable=False),
        sa.Column("checked_at", UTCDateTime(), nullable=True),
        sa.Column("last_check", JSONType, nullable=True),
    )
    op.create_table(
        "node_state_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("by", sa.String(100), nullable=True),
        sa.Column("data", JSONType, nullable=True),
    )
    op.create_index("ix_node_state_events_hostname", "node_state_events", ["hostname"])


def downgrade() -> None:
    op.drop_index("ix_node_state_events_hostname", table_name="node_state_events")
    op.drop_table("node_state_events")
    op.drop_table("node_states")
