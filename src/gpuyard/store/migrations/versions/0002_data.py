"""Data management: datasets and their versions.

Revision ID: 0002_data
Revises: 0001_core
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0002_data"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "dataset_versions",
        sa.Column(
            "dataset",
            sa.String(128),
            sa.ForeignKey("datasets.name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("parent", sa.String(200), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("num_rows", sa.BigInteger(), nullable=False),
        sa.Column("num_shards", sa.Integer(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("rows_in", sa.BigInteger(), nullable=False),
        sa.Column("rows_quarantined", sa.BigInteger(), nullable=False),
        sa.Column("quarantine_counts", JSONType, nullable=False),
        sa.Column("manifest_key", sa.Text(), nullable=False),
        sa.Column("manifest_sha256", sa.String(64), nullable=False),
        sa.Column("quarantine_key", sa.Text(), nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_dataset_versions_created_at", "dataset_versions", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_dataset_versions_created_at", table_name="dataset_versions")
    op.drop_table("dataset_versions")
    op.drop_table("datasets")
