"""/deployments: model servers in the store, their live latency/throughput/drift, and drift alerts.

Scoped by team like jobs and models: a deployment belongs to its model's team; a non-admin lists and
reads only their own team's deployments and their alerts (another team's deployment is 403; one that
does not exist is 404); an admin reaches every team's.
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Depends, Query, Request

from gpuyard.api.auth import authenticated, team_listing
from gpuyard.api.params import DeploymentId
from gpuyard.auth import Principal, check_team, visible_team
from gpuyard.limits import NAME_LEN, REF_LEN
from gpuyard.states import DeploymentState

router = APIRouter(prefix="/deployments", tags=["deployments"])


@router.get("")
def deployments(
    request: Request,
    all: bool = Query(False, description="include stopped, failed and dead ones"),
    team: str | None = Query(None, max_length=NAME_LEN),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """Deployments, newest first (active ones unless ``all``); vanished servers are marked dead.

    A non-admin sees only their team's deployments (``?team=`` of another team is 403).
    """
    from gpuyard.serve.deploy import list_deployments

    team = visible_team(principal, team)
    return team_listing(request, team, list_deployments(all_=all, team=team))


@router.get("/alerts")
def alerts(
    request: Request,
    model: str | None = Query(None, max_length=REF_LEN),
    limit: int = Query(100, ge=1, le=1000),
    team: str | None = Query(None, max_length=NAME_LEN),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """Drift alerts, newest first, optionally of one model.

    A non-admin sees only the alerts of their team's deployments.
    """
    from gpuyard.serve.alerts import list_alerts

    team = visible_team(principal, team)
    return team_listing(request, team, list_alerts(model, limit, team=team))


def _own_deployment(principal: Principal, deployment_id: int) -> dict[str, Any]:
    """The deployment, if the caller may see it (403 for another team's; 404 when none)."""
    from gpuyard.serve.records import get_deployment

    dep = get_deployment(deployment_id)
    check_team(principal, dep["team"], f"deployment {deployment_id}")
    return dep


@router.get("/{deployment_id}")
def deployment(deployment_id: DeploymentId, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """One deployment record."""
    return _own_deployment(principal, deployment_id)


@router.get("/{deployment_id}/live")
def live(
    request: Request, deployment_id: DeploymentId, principal: Principal = Depends(authenticated)
) -> dict[str, Any]:
    """The running server's own ``/stats`` (latency percentiles, throughput) and ``/drift`` report.

    Only the URL recorded for the deployment is asked (never one from the request), with the caller's
    own token (the model server accepts its team's tokens and admins'); a server that does not answer
    gives ``{"reachable": false, "error": ...}`` rather than an error status.
    """
    dep = _own_deployment(principal, deployment_id)
    out: dict[str, Any] = {"id": dep["id"], "status": dep["status"], "reachable": False}
    if dep["status"] != DeploymentState.RUNNING or not dep["url"]:
        return out | {"error": f"deployment is {dep['status']}"}
    base = f"{dep['url'].rstrip('/')}/v1/models/{dep['model']}"
    try:
        bearer = {"Authorization": request.headers.get("authorization", "")}
        with httpx.Client(timeout=3.0, headers=bearer) as http:
            out["stats"] = http.get(f"{base}/stats").raise_for_status().json()
            out["drift"] = http.get(f"{base}/drift").raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        return out | {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out | {"reachable": True}
