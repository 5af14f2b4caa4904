"""Auth: a token may belong to one job (its job-scoped token); NULL for a user's own tokens.

Revision ID: 0014_token_job
Revises: 0006_auth
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_token_job"
down_revision = "0006_auth"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No foreign key to jobs: the auth branch does not depend on the jobs branch (and a job's tokens
    # outlive nothing: they are revoked when it ends, and refused once it is no longer active).
    with op.batch_alter_table("auth_tokens") as batch:
        batch.add_column(sa.Column("job_id", sa.Integer(), nullable=True))
        batch.create_index("ix_auth_tokens_job_id", ["job_id"])


def downgrade() -> None:
    with op.batch_alter_table("auth_tokens") as batch:
        batch.drop_index("ix_auth_tokens_job_id")
        batch.drop_column("job_id")
