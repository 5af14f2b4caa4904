"""/datasets: the dataset catalog (each dataset's latest version, and every version of one)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gpuyard.api.params import Ref

router = APIRouter(prefix="/datasets", tags=["datasets"])


@router.get("")
def datasets() -> list[dict[str, Any]]:
    """One entry per dataset: its latest version's rows, shards, bytes and how many versions exist."""
    from gpuyard.data import list_datasets

    return list_datasets()


@router.get("/{name}")
def versions(name: Ref) -> list[dict[str, Any]]:
    """Every version of dataset ``name``, newest first (404 when unknown)."""
    from gpuyard.data import list_versions

    return list_versions(name)
