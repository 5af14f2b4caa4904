"""Serving tables: deployments (model servers and their processes), drift alerts, drift references."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class DeploymentRow(Base):
    """One model server started by ``gpuyard deploy`` (or ``gpuyard serve --deployment``)."""

    __tablename__ = "serve_deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(String(200), index=True)
    model_version: Mapped[int] = mapped_column(Integer)
    # The team the deployment belongs to: its model's team when it was deployed.
    team: Mapped[str] = mapped_column(String(100), default="default", server_default="default", index=True)
    # What the user asked for (``digits@production``): kept to show how the version was chosen.
    model_ref: Mapped[str] = mapped_column(String(300))
    replicas: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(String(32))
    # starting -> running -> stopped; failed (never became ready); dead (its process vanished).
    status: Mapped[str] = mapped_column(String(16), index=True)
    url: Mapped[str | None] = mapped_column(String(300))
    # The scheduler job holding the replicas' GPUs (GPU deployments); None: started directly.
    job_id: Mapped[int | None] = mapped_column(Integer, index=True)
    # {"server": pid, "replicas": [pid, ...], "devices": ["cpu", ...], "gpus": "2,3", "node": host}
    pids: Mapped[dict[str, Any]] = mapped_column(JSONType)
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    log_path: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class DriftAlertRow(Base):
    """A drift test that crossed its threshold on a served model's sliding window."""

    __tablename__ = "serve_alerts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment_id: Mapped[int | None] = mapped_column(
        ForeignKey("serve_deployments.id", ondelete="SET NULL"), index=True
    )
    model_name: Mapped[str] = mapped_column(String(200), index=True)
    model_version: Mapped[int] = mapped_column(Integer)
    # input_drift (one feature) or prediction_drift.
    kind: Mapped[str] = mapped_column(String(32))
    feature: Mapped[str | None] = mapped_column(String(200))
    # psi or ks
    metric: Mapped[str] = mapped_column(String(16))
    value: Mapped[float] = mapped_column(Float)
    threshold: Mapped[float] = mapped_column(Float)
    window_rows: Mapped[int] = mapped_column(Integer)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # What the retraining hook answered (None: no hook ran).
    retrain: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DriftReferenceRow(Base):
    """The training-data reference a model version's drift is measured against (bins and a sample)."""

    __tablename__ = "serve_drift_references"

    model_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    model_version: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Where the reference came from: "dataset:sklearn:digits", "array", ...
    source: Mapped[str] = mapped_column(String(300))
    reference: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
