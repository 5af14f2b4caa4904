"""/jobs: submit, list, show, events, logs, cancel, dry-run and straggler reports; each route calls one
JobService method."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuyard.api.auth import authenticated, team_listing
from gpuyard.api.params import JobId, Offset
from gpuyard.auth import Principal, check_team, visible_team
from gpuyard.errors import ConfigError, StoreError
from gpuyard.limits import NAME_LEN
from gpuyard.scheduler.eta import Forecaster, add_predictions, whatif_counts
from gpuyard.scheduler.goodput import add_goodput
from gpuyard.scheduler.spec import JobSpec, JobState

router = APIRouter(prefix="/jobs", tags=["jobs"])

# The spec is read as bytes and validated in the route's worker thread, not by FastAPI on the event
# loop: a large spec (up to the body cap) then never delays other requests. OpenAPI still shows it.
_SPEC_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}},
    }
}


async def _raw_body(request: Request) -> bytes:
    return await request.body()  # already read (and capped) by BodyLimit: no waiting here


def parse_spec_body(body: bytes) -> JobSpec:
    """A job spec from a request body, validated (call it off the event loop).

    Raises:
        RequestValidationError: not JSON, or an invalid field (422 naming each, as FastAPI's own).
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        msg = f"JSON decode error: {exc}" if isinstance(exc, ValueError) else "JSON nested too deeply"
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": msg}]) from None
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def add_schemas(doc: dict[str, Any]) -> None:
    """Put JobSpec and the models it uses into an OpenAPI document's components."""
    schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(schema.pop("$defs", {}))
    schemas["JobSpec"] = schema


def _service(request: Request) -> Any:
    service = request.app.state.jobs
    if service is None:
        raise StoreError("this server runs no job service")
    return service


def _own_job(request: Request, principal: Principal, job_id: int) -> Any:
    # Team scoping: a non-admin reaches only their team's jobs (403 otherwise; 404 if none exists).
    service = _service(request)
    check_team(principal, service.get(job_id)["team"], f"job {job_id}")
    return service


def _forecaster(request: Request, service: Any) -> Forecaster:
    # One per app and service: its cache serves every request until the queue changes.
    forecaster = getattr(request.app.state, "eta", None)
    if forecaster is None or forecaster.service is not service:
        forecaster = request.app.state.eta = Forecaster(service)
    return forecaster


def _predicted(request: Request, service: Any, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return add_predictions(_forecaster(request, service), docs)


def _as_caller(spec: JobSpec, principal: Principal) -> JobSpec:
    # A non-admin submits as themselves, into their own team; an admin as themselves unless the spec
    # names a user (the spec's default would be the server's OS user).
    if principal.is_admin:
        return spec if "user" in spec.model_fields_set else spec.model_copy(update={"user": principal.user})
    check_team(principal, spec.team, "submitting a job")
    return spec.model_copy(update={"user": principal.user})


@router.post("", status_code=201, openapi_extra=_SPEC_BODY)
def submit(
    request: Request,
    response: Response,
    body: bytes = Depends(_raw_body),
    principal: Principal = Depends(authenticated),
    idempotency_key: str | None = Header(
        None,
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="a key of the client's choosing (e.g. a UUID): a retry with it returns the first job",
    ),
) -> dict[str, Any]:
    """Queue a job (422 naming the field when the spec is invalid or can never fit).

    With ``Idempotency-Key``, a later submission by the same user with the same key and spec queues
    nothing and returns the first job (200, ``Idempotent-Replayed: true``); another spec is a 422.
    """
    spec = _as_caller(parse_spec_body(body), principal)
    key = f"{principal.user}:{idempotency_key}" if idempotency_key is not None else None
    doc, created = _service(request).submit_once(spec, key)
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return dict(doc)


@router.post("/dry-run", openapi_extra=_SPEC_BODY)
def dry_run(
    request: Request,
    body: bytes = Depends(_raw_body),
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """Where the job would run now and what would be launched, without launching it."""
    return dict(_service(request).dry_run(_as_caller(parse_spec_body(body), principal)))


@router.post("/whatif", openapi_extra=_SPEC_BODY)
def whatif(
    request: Request,
    body: bytes = Depends(_raw_body),
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """When the job would start and end if submitted now, for several GPU counts side by side
    (nothing is submitted): ``{"shapes": [{"gpus", "shape", "start", "end", ...}]}``."""
    spec = _as_caller(parse_spec_body(body), principal)
    service = _service(request)
    service.check(spec)
    if spec.resources.gpus < 1 and not spec.resources.shared:
        raise ConfigError("whatif forecasts jobs that use GPUs; this one is CPU-only")
    forecaster = _forecaster(request, service)
    # Counts past what one job of this type could get on this executor would only say "never".
    largest = max(1, forecaster.largest(spec.resources.gpu_type))
    counts = whatif_counts(spec.resources.gpus, largest, spec.resources.gpus_max)
    return {"shapes": forecaster.whatif(spec, counts or [spec.resources.gpus])}


@router.get("")
def list_jobs(
    request: Request,
    state: JobState | None = None,
    team: str | None = Query(None, max_length=NAME_LEN),
    limit: int = Query(200, ge=1, le=10000),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """Jobs, newest first (a non-admin sees only their team's)."""
    team = visible_team(principal, team)
    service = _service(request)
    docs = add_goodput(service.store, list(service.list_jobs(state=state, team=team, limit=limit)))
    return team_listing(request, team, _predicted(request, service, docs))


@router.get("/metrics")
def metrics(
    request: Request,
    team: str | None = Query(None, max_length=NAME_LEN),
    limit: int = Query(200, ge=1, le=10000),
    principal: Principal = Depends(authenticated),
) -> Response:
    """Prometheus gauges of the newest jobs' goodput (a non-admin: their team's): ETTR, wall,
    productive and lost seconds by cause, labelled job, name, team, state."""
    from gpuyard.scheduler.goodput import prometheus_text

    team = visible_team(principal, team)
    service = _service(request)
    docs = add_goodput(service.store, list(service.list_jobs(team=team, limit=limit)))
    return Response(prometheus_text(docs), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/{job_id}")
def show(job_id: JobId, request: Request, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """One job, with its goodput (ETTR and the time lost by cause) and its predicted start and end
    (docs/scheduler.md)."""
    service = _own_job(request, principal, job_id)
    return _predicted(request, service, add_goodput(service.store, [dict(service.get(job_id))]))[0]


@router.get("/{job_id}/events")
def events(
    job_id: JobId, request: Request, principal: Principal = Depends(authenticated)
) -> list[dict[str, Any]]:
    """A job's state changes."""
    return list(_own_job(request, principal, job_id).events(job_id))


@router.get("/{job_id}/logs")
def logs(
    job_id: JobId,
    request: Request,
    offset: Offset = 0,
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """A chunk of the job's log from ``offset``: ``{"text", "offset", "done", "state"}``."""
    return dict(_own_job(request, principal, job_id).read_log(job_id, offset))


class StragglerReport(BaseModel):
    """A rank that stays slower than the others (``gpuyard.train.straggler``), as its launcher saw it."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=0, le=1_048_576, description="global rank")
    node: str = Field(min_length=1, max_length=255, description="the scheduler's name of the rank's node")
    cause: Literal["data", "compute", "link"]
    slowdown: float = Field(gt=0, le=1e6, description="its time over the other ranks' median")
    step: int = Field(ge=0, le=2**53, description="the step it was named at")


@router.post("/{job_id}/stragglers")
def straggler(
    job_id: JobId, report: StragglerReport, request: Request, principal: Principal = Depends(authenticated)
) -> dict[str, Any]:
    """Report a straggler of a job (its launcher does, with the job's token): an event on the job; with
    ``on_straggler: restart`` also a restart without that node when one is free. ``{"restarting",
    "reason"}``."""
    return dict(_own_job(request, principal, job_id).report_straggler(job_id, report.model_dump()))


@router.post("/{job_id}/cancel")
def cancel(job_id: JobId, request: Request, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Cancel a job (a running one is stopped: SIGTERM, then SIGKILL after the grace period)."""
    return dict(_own_job(request, principal, job_id).cancel(job_id))
