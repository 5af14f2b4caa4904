"""The API application factory: routes, the health check, and gpuyard errors as 4xx JSON."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import gpuyard
from gpuyard.api.body import BodyLimit
from gpuyard.api.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from gpuyard.errors import GpuyardError


def create_app(
    jobs: Any = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """Build the API.

    Args:
        jobs: the :class:`gpuyard.scheduler.service.JobService` behind ``/jobs`` (None: no job routes
            answer; they return 503).
        max_body_bytes: the largest request body (413 above it, before it is read).
        body_timeout_s: how long a request's body may take to arrive (408 after that).
    """
    app = FastAPI(title="gpuyard", version=gpuyard.__version__)
    app.state.jobs = jobs
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)

    @app.exception_handler(GpuyardError)
    async def _gpuyard_error(_: Request, exc: GpuyardError) -> JSONResponse:
        return JSONResponse(status_code=exc.http_status, content={"detail": str(exc)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": validation_detail(exc.errors())})

    @app.get("/health")
    async def health() -> dict[str, Any]:  # async: answers even when every worker thread is busy
        """Liveness: the version, and whether the job service is attached."""
        return {"status": "ok", "version": gpuyard.__version__, "jobs": app.state.jobs is not None}

    from gpuyard.api.auth import authenticated
    from gpuyard.api.routes import cluster, datasets, deployments, fabric, models, nodes, runs, users
    from gpuyard.api.routes import jobs as job_routes
    from gpuyard.auth import ensure_admin_token
    from gpuyard.errors import AuthenticationError
    from gpuyard.web import mount_dashboard

    @app.exception_handler(AuthenticationError)
    async def _unauthenticated(_: Request, exc: AuthenticationError) -> JSONResponse:
        return JSONResponse(
            status_code=401, content={"detail": str(exc)}, headers={"WWW-Authenticate": "Bearer"}
        )

    # Every router needs a token (viewers read only); /health, the dashboard page and /docs do not.
    app.include_router(job_routes.router, dependencies=[Depends(authenticated)])
    for module in (cluster, nodes, fabric, datasets, runs, models, deployments, users):
        app.include_router(module.router, dependencies=[Depends(authenticated)])
    mount_dashboard(app)
    _openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            job_routes.add_schemas(_openapi())  # the job spec is validated off the loop, not by FastAPI
        return _openapi()

    app.openapi = openapi  # type: ignore[method-assign]
    ensure_admin_token()  # embedded default, first start: user 'admin' and GPUYARD_HOME/token (0600)
    return app


def validation_detail(errors: Any) -> list[dict[str, Any]]:
    """FastAPI's list of invalid fields (``loc`` names each), without echoing a long input back."""
    out = []
    for err in errors:
        item = {k: v for k, v in err.items() if k not in ("input", "url")}
        shown = err.get("input")
        # Echo an input only when it is short and valid JSON (NaN and Infinity are not).
        if isinstance(shown, float) and not math.isfinite(shown):
            item["input"] = str(shown)
        elif isinstance(shown, (bool, int, float, str, type(None))) and len(str(shown)) <= 100:
            item["input"] = shown
        out.append(item)
    return list(jsonable_encoder(out))
