"""Job records in the store: the JSON view of a job, and state changes written together with their event."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from gpuyard.auth import revoke_job_tokens
from gpuyard.errors import ConflictError
from gpuyard.scheduler.spec import TRANSITIONS, JobState
from gpuyard.store.base import utcnow
from gpuyard.store.tables.jobs import JobEventRow, JobRow

# States in which a job holds its placement's GPUs.
ACTIVE = (JobState.SCHEDULED.value, JobState.RUNNING.value)


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when else None


def job_doc(row: JobRow) -> dict[str, Any]:
    """The JSON view of a job (API and CLI)."""
    return {
        "id": row.id,
        "name": row.name,
        "team": row.team,
        "user": row.user,
        "priority": row.priority,
        "gpus": row.gpus,
        "state": row.state,
        "placement": row.placement,
        "attempts": row.attempts,
        "failures": row.failures,
        "preemptions": row.preemptions,
        "exit_code": row.exit_code,
        "reason": row.reason,
        "stop_requested": row.stop_requested,
        "resize_to": row.resize_to,
        "avoid_nodes": row.avoid_nodes or [],
        "log_path": row.log_path,
        "submitted_at": _iso(row.submitted_at),
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
        "spec": row.spec,
    }


def move(
    s: Session,
    row: JobRow,
    to: JobState,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> None:
    """Change a job's state (only along ``TRANSITIONS``) and record the change as an event.

    Raises:
        ConflictError: the transition is not allowed (e.g. cancelling a finished job).
    """
    frm = JobState(row.state)
    if to not in TRANSITIONS[frm]:
        raise ConflictError(f"job {row.id} is {frm.value}; it cannot become {to.value}")
    when = at or utcnow()
    if frm in (JobState.SCHEDULED, JobState.RUNNING) and to is not JobState.RUNNING:
        revoke_job_tokens(s, row.id)  # the attempt is over: its job-scoped token dies with it
    row.state, row.reason = to.value, reason
    if to is JobState.QUEUED:
        row.queued_at = when
    if to.terminal:
        row.finished_at = when
    s.add(
        JobEventRow(job_id=row.id, at=when, from_state=frm.value, to_state=to.value, reason=reason, data=data)
    )
