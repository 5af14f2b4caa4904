"""Model management: runs, run metrics and artifacts, evaluations, model versions, aliases, events.

Revision ID: 0004_models
Revises: 0001_core
Create Date: 2026-11-22

Optuna's own tables (studies, trials, ...) are not here: Optuna creates and migrates them itself, in a
schema (PostgreSQL) or a file (SQLite) of their own, see ``gpuyard.models.tune.optuna_storage``.
"""

import sqlalchemy as sa
from alembic import op

from gpuyard.store.base import JSONType, UTCDateTime

revision = "0004_models"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("experiment", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("parent_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="SET NULL"), nullable=True),
        sa.Column("params", JSONType, nullable=False),
        sa.Column("tags", JSONType, nullable=False),
        sa.Column("system", JSONType, nullable=False),
        sa.Column("code_version", sa.String(64), nullable=True),
        sa.Column("dataset_version", sa.String(300), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_runs_experiment", "runs", ["experiment"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_parent_id", "runs", ["parent_id"])

    op.create_table(
        "run_metrics",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("logged_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_run_metrics_run_key_step", "run_metrics", ["run_id", "key", "step"])

    op.create_table(
        "run_artifacts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(300), nullable=False),
        sa.Column("key", sa.String(500), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_run_artifacts_run_name"),
    )
    op.create_index("ix_run_artifacts_run_id", "run_artifacts", ["run_id"])

    op.create_table(
        "model_evaluations",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=True),
        sa.Column("model_name", sa.String(200), nullable=True),
        sa.Column("model_version", sa.Integer(), nullable=True),
        sa.Column("split", sa.String(32), nullable=False),
        sa.Column("task", sa.String(32), nullable=False),
        sa.Column("dataset_version", sa.String(300), nullable=True),
        sa.Column("n_samples", sa.Integer(), nullable=False),
        sa.Column("metrics", JSONType, nullable=False),
        sa.Column("details", JSONType, nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_model_evaluations_run_id", "model_evaluations", ["run_id"])
    op.create_index("ix_model_evaluations_model_name", "model_evaluations", ["model_name"])

    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("flavor", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="SET NULL"), nullable=True),
        sa.Column("dataset_version", sa.String(300), nullable=True),
        sa.Column("code_version", sa.String(64), nullable=True),
        sa.Column("metrics", JSONType, nullable=False),
        sa.Column("signature", JSONType, nullable=False),
        sa.Column("files", JSONType, nullable=False),
        sa.Column("config", JSONType, nullable=False),
        sa.Column("lineage", JSONType, nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("name", "version", name="uq_model_versions_name_version"),
    )
    op.create_index("ix_model_versions_name", "model_versions", ["name"])

    op.create_table(
        "model_aliases",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("alias", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )

    op.create_table(
        "model_events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("detail", JSONType, nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_model_events_name", "model_events", ["name"])


def downgrade() -> None:
    for index, table in (
        ("ix_model_events_name", "model_events"),
        ("ix_model_versions_name", "model_versions"),
        ("ix_model_evaluations_model_name", "model_evaluations"),
        ("ix_model_evaluations_run_id", "model_evaluations"),
        ("ix_run_artifacts_run_id", "run_artifacts"),
        ("ix_run_metrics_run_key_step", "run_metrics"),
        ("ix_runs_parent_id", "runs"),
        ("ix_runs_status", "runs"),
        ("ix_runs_experiment", "runs"),
    ):
        op.drop_index(index, table_name=table)
    for table in ("model_events", "model_aliases", "model_versions", "model_evaluations"):
        op.drop_table(table)
    for table in ("run_artifacts", "run_metrics", "runs"):
        op.drop_table(table)
