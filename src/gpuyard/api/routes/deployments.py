"""/deployments: model servers in the store, their live latency/throughput/drift, and drift alerts."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Query

from gpuyard.api.limits import REF_LEN
from gpuyard.api.params import DeploymentId
from gpuyard.states import DeploymentState

router = APIRouter(prefix="/deployments", tags=["deployments"])


@router.get("")
def deployments(
    all: bool = Query(False, description="include stopped, failed and dead ones"),
) -> list[dict[str, Any]]:
    """Deployments, newest first (active ones unless ``all``); vanished servers are marked dead."""
    from gpuyard.serve.deploy import list_deployments

    return list_deployments(all_=all)


@router.get("/alerts")
def alerts(
    model: str | None = Query(None, max_length=REF_LEN), limit: int = Query(100, ge=1, le=1000)
) -> list[dict[str, Any]]:
    """Drift alerts, newest first, optionally of one model."""
    from gpuyard.serve.alerts import list_alerts

    return list_alerts(model, limit)


@router.get("/{deployment_id}")
def deployment(deployment_id: DeploymentId) -> dict[str, Any]:
    """One deployment record."""
    from gpuyard.serve.records import get_deployment

    return get_deployment(deployment_id)


@router.get("/{deployment_id}/live")
def live(deployment_id: DeploymentId) -> dict[str, Any]:
    """The running server's own ``/stats`` (latency percentiles, throughput) and ``/drift`` report.

    Only the URL recorded for the deployment is asked (never one from the request); a server that
    does not answer gives ``{"reachable": false, "error": ...}`` rather than an error status.
    """
    from gpuyard.serve.records import get_deployment

    dep = get_deployment(deployment_id)
    out: dict[str, Any] = {"id": dep["id"], "status": dep["status"], "reachable": False}
    if dep["status"] != DeploymentState.RUNNING or not dep["url"]:
        return out | {"error": f"deployment is {dep['status']}"}
    base = f"{dep['url'].rstrip('/')}/v1/models/{dep['model']}"
    try:
        with httpx.Client(timeout=3.0) as http:
            out["stats"] = http.get(f"{base}/stats").raise_for_status().json()
            out["drift"] = http.get(f"{base}/drift").raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        return out | {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out | {"reachable": True}
