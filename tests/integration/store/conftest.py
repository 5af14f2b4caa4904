"""Fixtures of the store tests: a database of each backend, and a migration's round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from gpuyard.store.db import Store, _alembic_config


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database: a SQLite file, then PostgreSQL (the suite's server)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("pg_url"))


def migrate_to(conn: Any, store: Store, how: str, revision: str) -> None:
    """Upgrade or downgrade (``how``) the database behind ``conn`` to ``revision`` and commit."""
    from alembic import command

    cfg = _alembic_config(store.engine)
    cfg.attributes["connection"] = conn
    getattr(command, how)(cfg, revision)
    conn.commit()


def backfill_round_trip(
    db_url: str, before: str, rows: list[str], query: str, expected: Any, table: str
) -> None:
    """A new column's round trip: at revision ``before`` insert ``rows`` (SQL), migrate to the heads,
    check ``query`` gives ``expected`` (the backfill), downgrade to ``before`` and check the column
    ``query`` selects is gone from ``table``."""
    column = query.split()[1]
    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            migrate_to(conn, store, "upgrade", before)
            for row in rows:
                conn.execute(text(row))
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text(query)).scalar() == expected
            migrate_to(conn, store, "downgrade", before)
            assert column not in {c["name"] for c in inspect(conn).get_columns(table)}
    finally:
        store.dispose()
