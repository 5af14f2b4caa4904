"""Serving: deployments, drift alerts, drift references.

Revision ID: 0005_serve
Revises: 0001_core
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0005_serve"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "serve_deployments",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model_name", sa.String(200), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("model_ref", sa.String(300), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("url", sa.String(300), nullable=True),
        sa.Column("pids", JSONType, nullable=False),
        sa.Column("config", JSONType, nullable=False),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("stopped_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_serve_deployments_model_name", "serve_deployments", ["model_name"])
    op.create_index("ix_serve_deployments_status", "serve_deployments", ["status"])
    op.create_table(
        "serve_alerts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "deployment_id",
            sa.Integer(),
            sa.ForeignKey("serve_deployments.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("model_name", sa.String(200), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("feature", sa.String(200), nullable=True),
        sa.Column("metric", sa.String(16), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("window_rows", sa.Integer(), nullable=False),
        sa.Column("detail", JSONType, nullable=False),
        sa.Column("retrain", JSONType, nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_serve_alerts_deployment_id", "serve_alerts", ["deployment_id"])
    op.create_index("ix_serve_alerts_model_name", "serve_alerts", ["model_name"])
    op.create_table(
        "serve_drift_references",
        sa.Column("model_name", sa.String(200), primary_key=True),
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("source", sa.String(300), nullable=False),
        sa.Column("reference", JSONType, nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("serve_drift_references")
    op.drop_index("ix_serve_alerts_model_name", "serve_alerts")
    op.drop_index("ix_serve_alerts_deployment_id", "serve_alerts")
    op.drop_table("serve_alerts")
    op.drop_index("ix_serve_deployments_status", "serve_deployments")
    op.drop_index("ix_serve_deployments_model_name", "serve_deployments")
    op.drop_table("serve_deployments")
