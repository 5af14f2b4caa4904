"""Fixtures for model-management integration tests: an isolated home, on SQLite or PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def home(gpuyard_home: Path) -> Iterator[Path]:
    """An isolated GPUYARD_HOME with the SQLite state store."""
    yield gpuyard_home


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(
    request: pytest.FixtureRequest, gpuyard_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """An isolated home whose state store is SQLite, then a fresh PostgreSQL database."""
    from gpuyard.store.db import reset_store_cache

    if request.param == "postgresql":
        url = str(request.getfixturevalue("pg_url"))
        monkeypatch.setenv("GPUYARD_DATABASE_URL", url)
        reset_store_cache()
    yield request.param
    reset_store_cache()
