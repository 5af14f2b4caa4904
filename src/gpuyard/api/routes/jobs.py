"""/jobs: submit, list, show, events, logs, cancel and dry-run; each route calls one JobService method."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from gpuyard.errors import StoreError
from gpuyard.scheduler.spec import JobSpec

router = APIRouter(prefix="/jobs", tags=["jobs"])


def _service(request: Request) -> Any:
    service = request.app.state.jobs
    if service is None:
        raise StoreError("this server runs no job service")
    return service


@router.post("", status_code=201)
def submit(spec: JobSpec, request: Request) -> dict[str, Any]:
    """Queue a job (422 naming the field when the spec is invalid or can never fit)."""
    return dict(_service(request).submit(spec))


@router.post("/dry-run")
def dry_run(spec: JobSpec, request: Request) -> dict[str, Any]:
    """Where the job would run now and what would be launched, without launching it."""
    return dict(_service(request).dry_run(spec))


@router.get("")
def list_jobs(
    request: Request,
    state: str | None = None,
    team: str | None = None,
    limit: int = Query(200, ge=1, le=10000),
) -> list[dict[str, Any]]:
    """Jobs, newest first."""
    return list(_service(request).list_jobs(state=state, team=team, limit=limit))


@router.get("/{job_id}")
def show(job_id: int, request: Request) -> dict[str, Any]:
    """One job."""
    return dict(_service(request).get(job_id))


@router.get("/{job_id}/events")
def events(job_id: int, request: Request) -> list[dict[str, Any]]:
    """A job's state changes."""
    return list(_service(request).events(job_id))


@router.get("/{job_id}/logs")
def logs(job_id: int, request: Request, offset: int = Query(0, ge=0)) -> dict[str, Any]:
    """A chunk of the job's log from ``offset``: ``{"text", "offset", "done", "state"}``."""
    return dict(_service(request).read_log(job_id, offset))


@router.post("/{job_id}/cancel")
def cancel(job_id: int, request: Request) -> dict[str, Any]:
    """Cancel a job (a running one is stopped: SIGTERM, then SIGKILL after the grace period)."""
    return dict(_service(request).cancel(job_id))
