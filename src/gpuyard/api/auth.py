"""The API's authentication: a FastAPI dependency that turns ``Authorization: Bearer`` into a Principal.

Every router but ``/health`` is included with :func:`authenticated` as a dependency. Viewers may
only read (GET/HEAD); ``/users`` and ``/tokens`` further need an admin (checked in their routes).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gpuyard.auth import Principal, authenticate, list_users, require_write
from gpuyard.errors import NotFoundError, PermissionDenied

# auto_error=False: a missing header must give 401 with our message, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="An API token from `gpuyard tokens create`.")
_READ_METHODS = ("GET", "HEAD", "OPTIONS")
# What a job-scoped token reaches: its own job (read, events, logs, cancel, straggler reports) and who
# it is.
_JOB_SCOPE = re.compile(r"^/jobs/(\d+)(?:/events|/logs|/cancel|/stragglers)?/?$")


def _check_job_scope(request: Request, job_id: int) -> None:
    path = request.url.path
    match = _JOB_SCOPE.match(path)
    if path.rstrip("/") == "/me" or (match is not None and int(match.group(1)) == job_id):
        return
    raise PermissionDenied(
        f"a job token reaches only its own job: /jobs/{job_id} (and /events, /logs, /cancel, "
        f"/stragglers) and /me, not {path}"
    )


def authenticated(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> Principal:
    """The caller of this request (401 without a valid token; 403 for a viewer that writes)."""
    principal = authenticate(creds.credentials if creds else None)
    if principal.job_id is not None:
        _check_job_scope(request, principal.job_id)
    if request.method not in _READ_METHODS:
        require_write(principal)
    request.state.principal = principal
    return principal


def known_teams(request: Request) -> set[str]:
    """The teams this server knows: ``default``, its users' teams and its job service's ``--team``s."""
    known = {"default"} | {user["team"] for user in list_users()}
    service = getattr(request.app.state, "jobs", None)
    if service is not None:
        known |= set(service.config.teams)
    return known


def team_listing(request: Request, team: str | None, rows: list[Any]) -> list[Any]:
    """``rows``, a listing filtered by ``team``; an empty one for a team nobody knows is a 404 instead.

    A typo in ``?team=`` (or ``--team`` of an ``ls`` command) would otherwise look like a team with
    nothing in it. Objects may carry teams the server was not told of (a dataset ingested with
    ``--team``), so only an empty listing is checked.

    Raises:
        NotFoundError: nothing matched and ``team`` is not a known team (the known ones are named).
    """
    if team is None or rows:
        return rows
    known = known_teams(request)
    if team not in known:
        raise NotFoundError(f"team {team!r} is unknown; known teams: {', '.join(sorted(known))}")
    return rows
