"""The API application factory: routes, the health check, and gpuyard errors as 4xx JSON."""

from __future__ import annotations

import asyncio
import errno
import math
import os
import sqlite3
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import gpuyard
from gpuyard.api.body import BodyLimit
from gpuyard.errors import GpuyardError, StoreError
from gpuyard.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

# How long /ready waits for the database (a PostgreSQL that does not answer hangs a connect).
READY_TIMEOUT_S = 5.0


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
        full = disk_full_detail(exc)
        if full is not None:
            return JSONResponse(status_code=507, content={"detail": full})
        return JSONResponse(status_code=exc.http_status, content={"detail": str(exc)})

    @app.exception_handler(OSError)
    async def _os_error(_: Request, exc: OSError) -> JSONResponse:
        full = disk_full_detail(exc)
        if full is None:
            raise exc  # any other OSError is a bug: a 500 with its traceback
        return JSONResponse(status_code=507, content={"detail": full})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": validation_detail(exc.errors())})

    @app.get("/health")
    async def health() -> dict[str, Any]:  # async: answers even when every worker thread is busy
        """Liveness only: the process answers HTTP. It reads neither the database nor the disk (that
        is ``/ready``): a load balancer restarting on a failed /health would not cure an outage."""
        return {
            "status": "ok",
            "checks": "liveness: this process answers (database and disk: see /ready)",
            "version": gpuyard.__version__,
            "jobs": app.state.jobs is not None,
        }

    @app.get("/ready", responses={503: {"description": "the database cannot be read or written"}})
    async def ready() -> JSONResponse:
        """Readiness: the state store answers a query within READY_TIMEOUT_S (200), else 503 saying why;
        also the free space of GPUYARD_HOME's disk (a full disk refuses submissions with 507)."""
        store = app.state.jobs.store if app.state.jobs is not None else None
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                database = await asyncio.to_thread(_check_database, store)
        except TimeoutError:
            database = f"no answer within {READY_TIMEOUT_S:g} s"
        doc: dict[str, Any] = {"status": "ready" if database == "ok" else "unavailable"}
        doc["checks"] = {"database": database, "disk": _disk_note()}
        return JSONResponse(status_code=200 if database == "ok" else 503, content=doc)

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


def _check_database(store: Any) -> str:
    """``ok``, or why the state store cannot be queried (one line)."""
    from sqlalchemy import text

    from gpuyard.store.db import get_store

    try:
        with (store or get_store()).read() as s:
            s.execute(text("SELECT 1")).all()
    except Exception as exc:  # any failure is the answer, said in one line
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "ok"


def _disk_note() -> str:
    from gpuyard.settings import load_settings

    home = load_settings().home
    try:
        st = os.statvfs(home)
    except OSError as exc:
        return f"{home}: {exc.strerror}"
    return f"{home}: {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"


def disk_full_detail(exc: BaseException) -> str | None:
    """The one-line answer for an error caused by a full disk (ENOSPC, EDQUOT, SQLite's SQLITE_FULL);
    None for any other error."""
    seen: BaseException | None = exc
    for _ in range(8):  # the error and its causes
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            where = seen.filename or _home_or_store()
            return f"disk full: no space left on the disk of {where}; free space there and retry"
        if isinstance(seen, sqlite3.OperationalError) and "disk is full" in str(seen):
            return (
                f"disk full: the state store {_home_or_store()} cannot grow (no space left on its disk); "
                "free space there and retry"
            )
        if isinstance(seen, StoreError) and "disk is full" in str(seen):
            return f"disk full: {seen} (no space left on its disk); free space there and retry"
        seen = seen.__cause__ or seen.__context__
    return None


def _home_or_store() -> str:
    from gpuyard.settings import load_settings

    settings = load_settings()
    return str(settings.home / "gpuyard.db") if settings.is_sqlite else str(settings.home)
