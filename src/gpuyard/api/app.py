"""The API application factory: routes, the health check, and gpuyard errors as 4xx JSON."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import gpuyard
from gpuyard.errors import GpuyardError


def create_app(jobs: Any = None) -> FastAPI:
    """Build the API.

    Args:
        jobs: the :class:`gpuyard.scheduler.service.JobService` behind ``/jobs`` (None: no job routes
            answer; they return 503).
    """
    app = FastAPI(title="gpuyard", version=gpuyard.__version__)
    app.state.jobs = jobs

    @app.exception_handler(GpuyardError)
    async def _gpuyard_error(_: Request, exc: GpuyardError) -> JSONResponse:
        return JSONResponse(status_code=exc.http_status, content={"detail": str(exc)})

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Liveness: the version, and whether the job service is attached."""
        return {"status": "ok", "version": gpuyard.__version__, "jobs": app.state.jobs is not None}

    from gpuyard.api.routes import jobs as job_routes

    app.include_router(job_routes.router)
    return app
