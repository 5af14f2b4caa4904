"""Authentication: users and hashed API tokens.

Revision ID: 0006_auth
Revises: 0001_core
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import UTCDateTime

revision = "0006_auth"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "auth_users",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("team", sa.String(100), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "auth_tokens",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "user", sa.String(100), sa.ForeignKey("auth_users.name", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("label", sa.String(100), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("last_used_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_auth_tokens_token_hash", "auth_tokens", ["token_hash"], unique=True)
    op.create_index("ix_auth_tokens_user", "auth_tokens", ["user"])


def downgrade() -> None:
    op.drop_index("ix_auth_tokens_user", "auth_tokens")
    op.drop_index("ix_auth_tokens_token_hash", "auth_tokens")
    op.drop_table("auth_tokens")
    op.drop_table("auth_users")
