"""/cluster: recorded nodes (inventory, GPUs, health, topology) and the scheduler's view of them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request

from gpuyard.api.auth import authenticated
from gpuyard.auth import Principal, require_admin
from gpuyard.scheduler.spec import JobState

router = APIRouter(prefix="/cluster", tags=["cluster"])


@router.get("/nodes")
def nodes() -> list[dict[str, Any]]:
    """Every node's latest inventory: CPUs, accelerators (utilization, memory, health), topology, NICs."""
    from gpuyard.hardware.record import recorded_nodes

    return recorded_nodes()


@router.get("/scheduler")
def scheduler(request: Request) -> dict[str, Any]:
    """The scheduler's nodes (GPU slots, excluded GPUs) and the jobs holding GPUs now."""
    service = request.app.state.jobs
    if service is None:
        return {"policy": None, "executor": None, "nodes": [], "active": []}
    active = [*service.list_jobs(state=JobState.RUNNING), *service.list_jobs(state=JobState.SCHEDULED)]
    return {
        "policy": service.policy.name,
        "executor": service.executor.name,
        "teams": dict(service.config.teams),
        "nodes": [asdict(n) | {"excluded": sorted(n.excluded)} for n in service.nodes],
        "active": active,
    }


@router.post("/probe")
def probe(principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Inventory the machine the server runs on now and record it (admin)."""
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.record import record_inventory

    require_admin(principal)
    inventory = probe_node()
    record_inventory(inventory)
    return inventory.to_dict()
