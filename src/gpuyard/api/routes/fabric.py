"""/fabric: cluster and model presets, and the parallelism planner (ranked plans with their breakdown)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.errors import NotFoundError

router = APIRouter(prefix="/fabric", tags=["fabric"])


class PlanRequest(BaseModel):
    """A planning question: which layout trains MODEL fastest on GPUS of CLUSTER."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        ..., max_length=100, description="model preset, e.g. llama3-70b (files are not read over HTTP)"
    )
    cluster: str = Field(..., max_length=100, description="cluster preset, e.g. dgx-h100")
    gpus: int = Field(..., ge=1, le=1_000_000)
    global_batch: int = Field(..., ge=1, le=10_000_000)
    seq_len: int | None = Field(None, ge=1, le=10_000_000)
    top: int = Field(5, ge=1, le=50)
    tp: int | None = Field(None, ge=1, le=1_000_000)
    pp: int | None = Field(None, ge=1, le=1_000_000)
    cp: int | None = Field(None, ge=1, le=1_000_000)
    ep: int | None = Field(None, ge=1, le=1_000_000)
    micro_batch: int | None = Field(None, ge=1, le=10_000_000)
    virtual_stages: int | None = Field(None, ge=1, le=1_000_000)
    recompute: Literal["none", "selective", "full"] | None = None
    zero: int | None = Field(None, ge=0, le=3)
    sequence_parallel: bool | None = None


@router.get("/presets")
def presets() -> dict[str, Any]:
    """Names of the cluster presets and model presets the planner knows."""
    from gpuyard.fabric.models import PRESETS
    from gpuyard.fabric.presets import list_presets

    return {"clusters": list_presets(), "models": sorted(PRESETS)}


@router.post("/plan")
def plan(req: PlanRequest) -> dict[str, Any]:
    """Ranked plans (layout, step time, MFU, memory, step breakdown) and why the first one wins."""
    from gpuyard.fabric.models import PRESETS
    from gpuyard.fabric.planner import Knobs, plan
    from gpuyard.fabric.presets import list_presets, load_cluster

    # Names only: load_cluster/load_model also read files, which a remote caller must not reach.
    if req.cluster not in list_presets():
        raise NotFoundError(f"cluster: unknown preset {req.cluster!r}; presets: {', '.join(list_presets())}")
    if req.model not in PRESETS:
        raise NotFoundError(f"model: unknown preset {req.model!r}; presets: {', '.join(sorted(PRESETS))}")
    knobs = Knobs(**req.model_dump(include=set(Knobs.__dataclass_fields__)))
    model, cluster = PRESETS[req.model], load_cluster(req.cluster)
    result = plan(model, cluster, req.gpus, req.global_batch, req.seq_len, knobs, req.top)
    return {
        "model": model.name,
        "cluster": cluster.name,
        "device": cluster.device_name,
        "gpus": req.gpus,
        "global_batch": req.global_batch,
        "seq_len": req.seq_len or model.seq_len,
        "considered": result.considered,
        "fitting": result.fitting,
        "explain": result.explain(),
        "plans": [p.to_dict() for p in result.plans],
    }
