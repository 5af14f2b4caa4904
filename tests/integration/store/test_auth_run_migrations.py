"""Migrations 0014_token_job (tokens stay users' own) and 0015_run_team (runs go to team default)."""

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


def test_existing_tokens_belong_to_no_job(db_url: str) -> None:
    from alembic import command

    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0006_auth")
            conn.execute(
                text(
                    "INSERT INTO auth_users (name, team, role, created_at)"
                    " VALUES ('u', 't', 'member', CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    'INSERT INTO auth_tokens ("user", label, token_hash, prefix, created_at)'
                    " VALUES ('u', 'mine', 'ab', 'gy_x', CURRENT_TIMESTAMP)"
                )
            )
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT job_id FROM auth_tokens WHERE label = 'mine'")).one() == (None,)
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0006_auth")
            conn.commit()
            assert "job_id" not in {c["name"] for c in inspect(conn).get_columns("auth_tokens")}
            assert conn.execute(text("SELECT label FROM auth_tokens")).scalar() == "mine"
    finally:
        store.dispose()


def test_existing_runs_go_to_the_default_team(db_url: str) -> None:
    # Migration 0015_run_team: runs (studies, trials, their artifacts) from before it are team default's.
    from alembic import command

    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0010_model_team")
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, experiment, kind, status, params, tags, system,"
                    " started_at) VALUES ('r1', 'old', 'default', 'train', 'finished', '{}', '{}', '{}',"
                    " CURRENT_TIMESTAMP)"
                )
            )
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT team FROM runs WHERE id = 'r1'")).scalar() == "default"
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0010_model_team")
            conn.commit()
            assert "team" not in {c["name"] for c in inspect(conn).get_columns("runs")}
    finally:
        store.dispose()
