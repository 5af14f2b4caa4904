"""Migration 0013_node_health: the node state tables come with it, keep rows, and go on downgrade."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from gpuyard.store.db import Store, _alembic_config

pytestmark = pytest.mark.integration


def test_node_state_tables_upgrade_and_downgrade(db_url: str) -> None:
    from alembic import command

    store = Store(db_url)
    try:
        with store.engine.connect() as conn:
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0009_job_idempotency")
            assert "node_states" not in inspect(conn).get_table_names()
            conn.commit()
        store.migrate()
        with store.engine.connect() as conn:
            conn.execute(
                text(
                    "INSERT INTO node_states (hostname, state, reason, source, since)"
                    " VALUES ('n1', 'drained', 'Xid 79', 'check', CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO node_state_events (hostname, at, from_state, to_state, reason, source)"
                    " VALUES ('n1', CURRENT_TIMESTAMP, 'healthy', 'drained', 'Xid 79', 'check')"
                )
            )
            conn.commit()
            assert (
                conn.execute(text("SELECT state FROM node_states WHERE hostname = 'n1'")).scalar()
                == "drained"
            )
            cfg = _alembic_config(store.engine)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0009_job_idempotency")
            conn.commit()
            tables = set(inspect(conn).get_table_names())
            assert not {"node_states", "node_state_events"} & tables
            assert "jobs" in tables  # the branch below it stays
        store.migrate()  # and up again
        with store.engine.connect() as conn:
            assert {"node_states", "node_state_events"} <= set(inspect(conn).get_table_names())
    finally:
        store.dispose()
