"""Scheduler tables: jobs (spec, state, placement, process handle) and their state-change events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from gpuyard.store.base import Base, JSONType, UTCDateTime, utcnow


class JobRow(Base):
    """One job: its spec as submitted, where it is in its life and where it runs."""

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    team: Mapped[str] = mapped_column(String(100))
    user: Mapped[str] = mapped_column(String(100))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    state: Mapped[str] = mapped_column(String(16))
    # Where it runs: {"nodes": [{"node": name, "gpus": [indices]}], "how": why}.
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    # What the executor needs to find the process again after a restart (pid, create time, files).
    handle: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    attained_s: Mapped[float] = mapped_column(Float, default=0.0)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set by cancel/preempt; the loop finishes the job once its process has gone.
    stop_requested: Mapped[str | None] = mapped_column(String(16), nullable=True)
    stop_deadline: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    killed: Mapped[bool] = mapped_column(Boolean, default=False)
    log_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # "USER:KEY" from the submission's Idempotency-Key header: a retry with it returns this job.
    idempotency_key: Mapped[str | None] = mapped_column(String(300), nullable=True)
    # An elastic job stopped to resize: the GPUs it restarts at (migration 0016); null otherwise.
    resize_to: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Nodes the job is not placed on again: where a straggler of it ran (migration 0017).
    avoid_nodes: Mapped[list[str] | None] = mapped_column(JSONType, nullable=True)

    __table_args__ = (
        Index("ix_jobs_state", "state"),
        Index("ix_jobs_team", "team"),
        Index("ix_jobs_idempotency_key", "idempotency_key", unique=True),
    )


class JobEventRow(Base):
    """One state change of a job (queued -> scheduled -> running -> ...), with why."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(Integer, ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)

    __table_args__ = (Index("ix_job_events_job_id", "job_id"),)


class SchedulerLeaseRow(Base):
    """Who schedules the jobs of this store: one row per lease name, held until ``expires_at``.

    Only the holder starts, reaps and recovers jobs, so two job services on one store (a server and an
    in-process service, or two servers on one PostgreSQL) never both start a job or requeue each
    other's running jobs.
    """

    __tablename__ = "scheduler_lease"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    # host:pid:random, unique per JobService instance.
    holder: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    # The holder's process create time: a reused pid on the same host is not taken for the holder.
    pid_started: Mapped[float] = mapped_column(Float)
    role: Mapped[str] = mapped_column(String(32))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
