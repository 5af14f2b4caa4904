"""/models: the registry (models, versions with stage, aliases, metrics and lineage, events)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.api.limits import WORD_LEN
from gpuyard.api.params import Ref, Version
from gpuyard.refs import ModelRef

router = APIRouter(prefix="/models", tags=["models"])


class StageRequest(BaseModel):
    """A stage to move a version to (production only through promotion, which compares on a holdout)."""

    model_config = ConfigDict(extra="forbid")

    stage: str = Field(..., max_length=WORD_LEN)


@router.get("")
def models() -> list[dict[str, Any]]:
    """One entry per model: versions, latest, production and staging versions, aliases."""
    from gpuyard.models.registry import list_models

    return list_models()


@router.get("/{name}")
def model(name: Ref) -> dict[str, Any]:
    """Every version of ``name`` (newest first) with metrics and lineage, and its recent events."""
    from gpuyard.models.registry import list_versions, model_events

    return {
        "name": name,
        "versions": [v.to_json() for v in list_versions(name)],
        "events": model_events(name),
    }


@router.get("/{name}/versions/{version}")
def version(name: Ref, version: Version) -> dict[str, Any]:
    """One version: flavor, stage, run, dataset and code version, metrics, signature, lineage."""
    from gpuyard.models.registry import get_version

    return get_version(str(ModelRef(name, version))).to_json()


@router.post("/{name}/versions/{version}/stage")
def stage(name: Ref, version: Version, req: StageRequest) -> dict[str, Any]:
    """Move a version to none, staging or archived (member or admin)."""
    from gpuyard.models.registry import set_stage

    return set_stage(str(ModelRef(name, version)), req.stage).to_json()
