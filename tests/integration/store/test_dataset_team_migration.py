"""Migrations 0011_dataset_team and 0012_deployment_team: rows from before them go to team 'default'."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from gpuyard.store.db import Store, _alembic_config

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("pg_url"))


def test_existing_datasets_go_to_the_default_team(db_url: str) -> None:
    from alembic import command

    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0002_data")
            conn.execute(text("INSERT INTO datasets (name, created_at) VALUES ('old', CURRENT_TIMESTAMP)"))
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT team FROM datasets WHERE name = 'old'")).scalar() == "default"
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0002_data")  # and back: the column goes
            conn.commit()
            assert "team" not in {c["name"] for c in inspect(conn).get_columns("datasets")}
    finally:
        store.dispose()


def test_existing_deployments_go_to_the_default_team(db_url: str) -> None:
    from alembic import command

    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0008_serve_job")
            conn.execute(
                text(
                    "INSERT INTO serve_deployments (model_name, model_version, model_ref, replicas, device,"
                    " status, pids, config, created_at, updated_at) VALUES ('clf', 1, 'clf', 1, 'cpu',"
                    " 'stopped', '{}', '{}', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT team FROM serve_deployments")).scalar() == "default"
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0008_serve_job")
            conn.commit()
            assert "team" not in {c["name"] for c in inspect(conn).get_columns("serve_deployments")}
    finally:
        store.dispose()
