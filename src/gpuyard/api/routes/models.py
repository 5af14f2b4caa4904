"""/models: the registry (models, versions with stage, aliases, metrics and lineage, events).

Scoped by team like jobs: a non-admin lists, reads and changes only their own team's models (another
team's model is 403; a model that does not exist is 404); an admin reaches every team's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.api.auth import authenticated, team_listing
from gpuyard.api.params import Ref, Version
from gpuyard.auth import Principal, check_team, visible_team
from gpuyard.limits import NAME_LEN, WORD_LEN
from gpuyard.refs import ModelRef

router = APIRouter(prefix="/models", tags=["models"])


class StageRequest(BaseModel):
    """A stage to move a version to (production only through promotion, which compares on a holdout)."""

    model_config = ConfigDict(extra="forbid")

    stage: str = Field(..., max_length=WORD_LEN)


def _own_model(principal: Principal, name: str) -> None:
    """Refuse a non-admin reaching another team's model (403; 404 when no such model exists)."""
    from gpuyard.models.registry import model_team

    check_team(principal, model_team(name), f"model {name!r}")


@router.get("")
def models(
    request: Request,
    team: str | None = Query(None, max_length=NAME_LEN),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """One entry per model: team, versions, latest, production and staging versions, aliases.

    A non-admin sees only their team's models.
    """
    from gpuyard.models.registry import list_models

    team = visible_team(principal, team)
    return team_listing(request, team, list_models(team=team))


@router.get("/{name}")
def model(name: Ref, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Every version of ``name`` (newest first) with metrics and lineage, and its recent events."""
    from gpuyard.models.registry import list_versions, model_events

    _own_model(principal, name)
    return {
        "name": name,
        "versions": [v.to_json() for v in list_versions(name)],
        "events": model_events(name),
    }


@router.get("/{name}/versions/{version}")
def version(name: Ref, version: Version, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """One version: flavor, stage, run, dataset and code version, metrics, signature, lineage."""
    from gpuyard.models.registry import get_version

    _own_model(principal, name)
    return get_version(str(ModelRef(name, version))).to_json()


@router.post("/{name}/versions/{version}/stage")
def stage(
    name: Ref, version: Version, req: StageRequest, principal: Principal = Depends(authenticated)
) -> dict[str, Any]:
    """Move a version of one's own team's model to none, staging or archived (member or admin)."""
    from gpuyard.models.registry import set_stage

    _own_model(principal, name)
    return set_stage(str(ModelRef(name, version)), req.stage).to_json()
