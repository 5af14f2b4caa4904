"""Model-management tables: tracked runs, their metrics and artifacts, evaluations, registered models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class RunRow(Base):
    """One tracked run: a training job, a tuning study, a trial, a cross-validation or one of its folds."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    experiment: Mapped[str] = mapped_column(String(200), index=True)
    # The team the run belongs to (a study's trials and a cv's folds have their parent's team).
    team: Mapped[str] = mapped_column(String(100), default="default", server_default="default", index=True)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSONType)
    tags: Mapped[dict[str, Any]] = mapped_column(JSONType)
    system: Mapped[dict[str, Any]] = mapped_column(JSONType)
    code_version: Mapped[str | None] = mapped_column(String(64))
    dataset_version: Mapped[str | None] = mapped_column(String(300))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class RunMetricRow(Base):
    """One point of one metric series of a run (``key`` at ``step``); system metrics use ``sys/``."""

    __tablename__ = "run_metrics"
    __table_args__ = (Index("ix_run_metrics_run_key_step", "run_id", "key", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(200))
    step: Mapped[int] = mapped_column(Integer)
    # NULL stands for a non-finite value (NaN/inf), which SQLite cannot store.
    value: Mapped[float | None] = mapped_column(Float)
    logged_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class RunArtifactRow(Base):
    """A file a run produced, stored in the artifact store under ``key`` with its SHA-256."""

    __tablename__ = "run_artifacts"
    __table_args__ = (UniqueConstraint("run_id", "name", name="uq_run_artifacts_run_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(300))
    key: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class EvaluationRow(Base):
    """Task metrics of a run or a model version on one split (validation, test, holdout, cv)."""

    __tablename__ = "model_evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    model_name: Mapped[str | None] = mapped_column(String(200), index=True)
    model_version: Mapped[int | None] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(32))
    task: Mapped[str] = mapped_column(String(32))
    dataset_version: Mapped[str | None] = mapped_column(String(300))
    n_samples: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # Confusion matrix and per-class figures: not scalars, so kept apart from ``metrics``.
    details: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ModelVersionRow(Base):
    """One registered version of a named model, with its lineage, signature, files and stage."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("name", "version", name="uq_model_versions_name_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    version: Mapped[int] = mapped_column(Integer)
    # The team the model belongs to (every version of a name has its first version's team).
    team: Mapped[str] = mapped_column(String(100), default="default", server_default="default", index=True)
    flavor: Mapped[str] = mapped_column(String(16))
    stage: Mapped[str] = mapped_column(String(16))
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    dataset_version: Mapped[str | None] = mapped_column(String(300))
    code_version: Mapped[str | None] = mapped_column(String(64))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType)
    signature: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # {file name: {key, sha256, size}}: the flavor's files, plus optimized variants added later.
    files: Mapped[dict[str, Any]] = mapped_column(JSONType)
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    lineage: Mapped[dict[str, Any]] = mapped_column(JSONType)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class ModelAliasRow(Base):
    """A movable name for one version (``digits@champion``)."""

    __tablename__ = "model_aliases"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class ModelEventRow(Base):
    """What happened to a model: registered, stage moved, promotion granted or refused, retrain."""

    __tablename__ = "model_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    version: Mapped[int | None] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(32))
    detail: Mapped[dict[str, Any]] = mapped_column(JSONType)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
