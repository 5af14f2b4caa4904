"""/nodes: the scheduler's nodes with their health state; drain and undrain (admins).

Anyone with a token lists and reads nodes; draining and undraining need an admin. A drained node gets
no new job and its preemptible jobs are moved off it (checkpoint on SIGTERM, requeue).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.api.auth import authenticated
from gpuyard.api.params import NodeName
from gpuyard.auth import Principal, require_admin
from gpuyard.errors import NotFoundError, StoreError

router = APIRouter(prefix="/nodes", tags=["nodes"])


class DrainBody(BaseModel):
    """Why a node is drained (shown in `gpuyard nodes ls` and kept in its history)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(..., min_length=1, max_length=500)


class UndrainBody(BaseModel):
    """Why a node goes back into service (optional)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500)


def _service(request: Request) -> Any:
    service = request.app.state.jobs
    if service is None:
        raise StoreError("this server runs no job service")
    return service


def _node(service: Any, name: str) -> Any:
    for node in service.nodes:
        if node.name == name:
            return node
    known = ", ".join(n.name for n in service.nodes[:10]) or "none"
    raise NotFoundError(f"node {name!r} is not one of the scheduler's nodes ({known})")


def _doc(service: Any, node: Any, state: dict[str, Any]) -> dict[str, Any]:
    active = service.list_jobs(state="running") + service.list_jobs(state="scheduled")
    jobs = [
        d["id"] for d in active if node.name in {p["node"] for p in (d["placement"] or {}).get("nodes", [])}
    ]
    return {
        **state,
        "gpus": node.gpus,
        "gpu_type": node.gpu_type,
        "excluded": sorted(node.excluded),
        "jobs": sorted(jobs),
    }


@router.get("")
def list_nodes(request: Request) -> list[dict[str, Any]]:
    """Every scheduler node: state (healthy/degraded/drained), reason, since, last check, jobs on it."""
    service = _service(request)
    states = service.node_states.states([n.name for n in service.nodes])
    return [_doc(service, n, st) for n, st in zip(service.nodes, states, strict=True)]


@router.get("/{name}")
def show(name: NodeName, request: Request, limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
    """One node's state, last check and history of state changes (oldest first)."""
    service = _service(request)
    node = _node(service, name)
    doc = _doc(service, node, service.node_states.get(name))
    return {**doc, "history": service.node_states.history(name, limit)}


@router.post("/{name}/drain")
def drain(
    name: NodeName, body: DrainBody, request: Request, principal: Principal = Depends(authenticated)
) -> dict[str, Any]:
    """Drain a node (admin): nothing new is placed on it; its preemptible jobs are moved off."""
    require_admin(principal)
    service = _service(request)
    node = _node(service, name)
    state = service.node_states.drain(name, body.reason, principal.user)
    service.wake.set()
    return _doc(service, node, state)


@router.post("/{name}/undrain")
def undrain(
    name: NodeName,
    request: Request,
    body: UndrainBody | None = None,
    principal: Principal = Depends(authenticated),
) -> dict[str, Any]:
    """Put a drained node back into service (admin; 409 when it is not drained)."""
    require_admin(principal)
    service = _service(request)
    node = _node(service, name)
    state = service.node_states.undrain(name, principal.user, body.reason if body else "")
    service.wake.set()
    return _doc(service, node, state)
