"""/datasets: the dataset catalog (each dataset's latest version, and every version of one).

Scoped by team like jobs and models: a non-admin lists and reads only their own team's datasets
(another team's dataset is 403; a dataset that does not exist is 404); an admin reaches every team's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from gpuyard.api.auth import authenticated, team_listing
from gpuyard.api.params import Ref
from gpuyard.auth import Principal, check_team, visible_team
from gpuyard.limits import NAME_LEN

router = APIRouter(prefix="/datasets", tags=["datasets"])


@router.get("")
def datasets(
    request: Request,
    team: str | None = Query(None, max_length=NAME_LEN),
    principal: Principal = Depends(authenticated),
) -> list[dict[str, Any]]:
    """One entry per dataset: its team, its latest version's rows, shards, bytes and how many versions exist.

    A non-admin sees only their team's datasets (``?team=`` of another team is 403).
    """
    from gpuyard.data import list_datasets

    team = visible_team(principal, team)
    return team_listing(request, team, list_datasets(team=team))


@router.get("/{name}")
def versions(name: Ref, principal: Principal = Depends(authenticated)) -> list[dict[str, Any]]:
    """Every version of dataset ``name``, newest first (404 when unknown, 403 for another team's)."""
    from gpuyard.data import list_versions
    from gpuyard.data.catalog import dataset_team

    check_team(principal, dataset_team(name), f"dataset {name!r}")
    return list_versions(name)
