"""The state store on SQLite and on a real PostgreSQL server: migrations, concurrent writers."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select

from gpuyard.store.db import Store, get_store, reset_store_cache
from gpuyard.store.tables import Base
from gpuyard.store.tables.core import NodeRow

pytestmark = pytest.mark.integration


def test_first_use_applies_every_migration(db_url: str) -> None:
    store = get_store(url=db_url)
    current, heads = store.revision_status()
    assert current == heads and heads
    assert "nodes" in inspect(store.engine).get_table_names()
    reset_store_cache()


def test_migrations_match_the_table_definitions(db_url: str) -> None:
    # A table changed in Python without a migration (or the reverse) shows up as a diff here.
    store = get_store(url=db_url)
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"tables and migrations disagree: {diff}"
    reset_store_cache()


def test_roundtrip_and_json(db_url: str) -> None:
    store = get_store(url=db_url)
    with store.session() as s:
        s.add(NodeRow(hostname="n1", inventory={"node": {"gpus": [1, 2]}}, health="pass"))
    with store.read() as s:
        row = s.get(NodeRow, "n1")
        assert row is not None and row.inventory == {"node": {"gpus": [1, 2]}}
        assert row.updated_at.tzinfo is not None
    reset_store_cache()


def test_failed_transaction_rolls_back(db_url: str) -> None:
    store = get_store(url=db_url)
    with pytest.raises(RuntimeError), store.session() as s:
        s.add(NodeRow(hostname="ghost", inventory={}, health="pass"))
        s.flush()
        raise RuntimeError("boom")
    with store.read() as s:
        assert s.get(NodeRow, "ghost") is None
    reset_store_cache()


def _writer(url: str, tag: str, n: int, ready: mp.Event, go: mp.Event) -> None:  # type: ignore[valid-type]
    store = Store(url)
    store.migrate()
    ready.set()
    go.wait(30)
    for i in range(n):
        # read-then-write in one transaction: the pattern that deadlocks with deferred SQLite BEGINs
        with store.session() as s:
            count = s.scalar(select(func.count()).select_from(NodeRow)) or 0
            s.add(NodeRow(hostname=f"{tag}-{i}", inventory={"seen": count}, health="pass"))
    store.dispose()


def test_two_processes_write_at_once(db_url: str) -> None:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event(), ctx.Event()]
    procs = [
        ctx.Process(target=_writer, args=(db_url, tag, 100, r, go))
        for tag, r in zip("ab", readies, strict=True)
    ]
    for p in procs:
        p.start()
    for r in readies:
        assert r.wait(60), "a writer did not start"
    go.set()
    for p in procs:
        p.join(240)  # generous: the test machine may be loaded; a deadlock fails by exit code
    assert [p.exitcode for p in procs] == [0, 0], "a writer failed (database is locked?)"
    store = get_store(url=db_url)
    with store.read() as s:
        assert s.scalar(select(func.count()).select_from(NodeRow)) == 200
    reset_store_cache()


def _migrator(url: str, go: mp.Event) -> None:  # type: ignore[valid-type]
    go.wait(30)
    Store(url).migrate()


def test_concurrent_first_use_migrates_once(db_url: str) -> None:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_migrator, args=(db_url, go)) for _ in range(3)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(240)  # generous: the test machine may be loaded; a deadlock fails by exit code
    assert [p.exitcode for p in procs] == [0, 0, 0]
    current, heads = Store(db_url).revision_status()
    assert current == heads


def test_default_store_is_sqlite_in_home(gpuyard_home: Path) -> None:
    store = get_store()
    assert store.is_sqlite
    assert (gpuyard_home / "gpuyard.db").exists()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_shipped_heads_agree_with_alembic() -> None:
    # The fast head reader (no Alembic import) must see what Alembic sees.
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from gpuyard.store.db import shipped_heads

    cfg = Config()
    cfg.set_main_option("script_location", "gpuyard.store:migrations")
    assert shipped_heads() == set(ScriptDirectory.from_config(cfg).get_heads())
