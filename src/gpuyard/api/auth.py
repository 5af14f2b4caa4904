"""The API's authentication: a FastAPI dependency that turns ``Authorization: Bearer`` into a Principal.

Every router but ``/health`` is included with :func:`authenticated` as a dependency. Viewers may
only read (GET/HEAD); ``/users`` and ``/tokens`` further need an admin (checked in their routes).
"""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gpuyard.auth import Principal, authenticate, require_write

# auto_error=False: a missing header must give 401 with our message, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="An API token from `gpuyard tokens create`.")
_READ_METHODS = ("GET", "HEAD", "OPTIONS")


def authenticated(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> Principal:
    """The caller of this request (401 without a valid token; 403 for a viewer that writes)."""
    principal = authenticate(creds.credentials if creds else None)
    if request.method not in _READ_METHODS:
        require_write(principal)
    request.state.principal = principal
    return principal
