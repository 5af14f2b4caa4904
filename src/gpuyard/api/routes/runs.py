"""/runs: tracked runs, their metric series (curves), side-by-side comparison and artifact downloads."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from gpuyard.api.auth import authenticated, team_listing
from gpuyard.api.params import Ref
from gpuyard.auth import Principal, check_team, visible_team
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.limits import ARTIFACT_NAME_LEN, NAME_LEN, REF_LEN, WORD_LEN

router = APIRouter(prefix="/runs", tags=["runs"])


def _own_run(principal: Principal, ref: str) -> str:
    """The run's full id, after refusing a non-admin another team's run (403 naming the team)."""
    from gpuyard.models.runs import get_run

    run = get_run(ref)
    check_team(principal, run.team, f"run {run.id[:8]}")
    return run.id


@router.get("")
def runs(
    request: Request,
    experiment: str | None = Query(None, max_length=REF_LEN),
    status: str | None = Query(None, max_length=WORD_LEN),
    kind: str | None = Query(None, max_length=WORD_LEN),
    team: str | None = Query(None, max_length=NAME_LEN),
    limit: int = Query(100, ge=1, le=1000),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """Runs, newest first, with the last value of each metric (a non-admin sees only their team's)."""
    from gpuyard.models.runs import list_runs

    team = visible_team(principal, team)
    found = [r.to_json() for r in list_runs(experiment, status, kind, limit=limit, team=team)]
    return team_listing(request, team, found)


@router.get("/compare")
def compare(
    ids: list[Annotated[str, Query(max_length=REF_LEN)]] = Query(..., min_length=2, max_length=20),
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """Params and latest metrics of several runs side by side; ``differs`` names the params that differ."""
    from gpuyard.models.runs import compare_runs

    return compare_runs([_own_run(principal, ref) for ref in ids])


@router.get("/{ref}")
def run(ref: Ref, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """One run in full: params, system info, artifacts, evaluations, children, series lengths, and
    ``goodput`` (ETTR and the time lost by cause, recorded every minute while it runs and when a
    launch ends; else null)."""
    from gpuyard.models.runs import run_details
    from gpuyard.train.goodput import of_run_doc

    doc = run_details(_own_run(principal, ref))
    doc["goodput"] = of_run_doc(doc)
    return doc


@router.get("/{ref}/metrics")
def metrics(
    ref: Ref,
    keys: list[Annotated[str, Query(max_length=REF_LEN)]] | None = Query(None, max_length=100),
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """``{"run": id, "series": {key: [[step, value], ...]}}`` (every key unless ``keys`` is given)."""
    from gpuyard.models.runs import metric_series

    run_id = _own_run(principal, ref)
    return {"run": run_id, "series": metric_series(run_id, keys)}


@router.get("/{ref}/artifacts/{name:path}")
def artifact(
    ref: Ref,
    name: Annotated[str, Path(max_length=ARTIFACT_NAME_LEN)],
    principal: Principal = Depends(authenticated),
) -> Response:
    """Download artifact ``name`` of a run, checked against its recorded SHA-256.

    Only names recorded for the run are served: the name picks a row, never a path on disk.
    """
    from gpuyard.models.runs import run_details
    from gpuyard.store import get_artifacts

    if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/") or "\x00" in name:
        raise ConfigError(f"artifact name {name!r}: must be a relative name without '..'")
    found = [a for a in run_details(_own_run(principal, ref))["artifacts"] if a["name"] == name]
    if not found:
        raise NotFoundError(f"run {ref!r} has no artifact {name!r}")
    data = get_artifacts().get_bytes(found[0]["key"], sha256=found[0]["sha256"])
    filename = name.rsplit("/", 1)[-1].replace('"', "")
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )
