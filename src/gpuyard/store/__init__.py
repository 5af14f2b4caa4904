"""State store (SQL, via SQLAlchemy + Alembic) and artifact store (fsspec)."""

from gpuyard.store.artifacts import ArtifactStore, get_artifacts
from gpuyard.store.db import Store, get_store

__all__ = ["ArtifactStore", "Store", "get_artifacts", "get_store"]
