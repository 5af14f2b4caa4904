"""The SQL state store: one engine per URL, migrations applied on first use, safe concurrent writers."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from gpuyard.errors import StoreError
from gpuyard.settings import Settings, load_settings

if TYPE_CHECKING:
    from alembic.config import Config

SQLITE_BUSY_TIMEOUT_S = 60
# Any constant works; it only has to be the same in every gpuyard process.
_PG_MIGRATION_LOCK = 0x6770_7579


def _sqlite_engine(url: str) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, issue BEGIN: pysqlite's implicit BEGIN is DEFERRED, and a
        # deferred reader that later writes fails with "database is locked" without waiting.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        _use_wal(cur)  # readers never block the writer, nor it them
        cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; a crash loses no committed data
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Writers take the write lock up front (and wait busy_timeout for it), so two processes that
        # both read-then-write queue up instead of deadlocking.
        conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get('sqlite_begin', 'IMMEDIATE')}")

    return engine


def _use_wal(cur: Any) -> None:
    """Switch the file to WAL once; a connection that finds it in WAL already changes nothing.

    Changing the journal mode needs the file to itself, and SQLite answers "database is locked" at once,
    without its busy handler, while another process holds a transaction (e.g. migrating a new file), so
    the switch is retried until that transaction ends or the busy timeout has passed.
    """
    import sqlite3
    import time

    if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # backing off while the other process's transaction ends


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


_VERSIONS_DIR = Path(__file__).parent / "migrations" / "versions"


def shipped_heads() -> set[str]:
    """Head revisions of the migrations shipped with this gpuyard.

    Read from the migration files' ``revision`` / ``down_revision`` assignments with ``ast``: a
    process that finds its database current then never imports Alembic (about half a second).
    """
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in _VERSIONS_DIR.glob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("revision", "down_revision"):
                value = ast.literal_eval(node.value)
                values = value if isinstance(value, tuple | list) else [value]
                (revisions if target.id == "revision" else parents).update(v for v in values if v)
    return revisions - parents


def _alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", "gpuyard.store:migrations")
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    return cfg


class Store:
    """The state store at one database URL.

    Use ``with store.session() as s:`` to write (commits on success, rolls back on error) and
    ``with store.read() as s:`` for read-only work.
    """

    def __init__(self, url: str, lock_dir: Path | None = None) -> None:
        self.url = url
        self.engine = _make_engine(url)
        self._lock_dir = lock_dir
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        reader = self.engine.execution_options(sqlite_begin="DEFERRED") if self.is_sqlite else self.engine
        self._readers = sessionmaker(reader, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        """True for the embedded SQLite backend."""
        return self.engine.dialect.name == "sqlite"

    @property
    def safe_url(self) -> str:
        """The URL with any password masked, for printing."""
        return self.engine.url.render_as_string(hide_password=True)

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A read-write transaction: committed when the block ends, rolled back on an exception."""
        with self._wrap_errors(), self._sessions.begin() as s:
            yield s

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only transaction (it does not take the SQLite write lock)."""
        with self._wrap_errors(), self._readers() as s:
            yield s

    @contextlib.contextmanager
    def _wrap_errors(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as exc:
            raise StoreError(f"state store {self.safe_url}: {exc.orig}") from exc

    # -- migrations -------------------------------------------------------------------------------

    def revision_status(self) -> tuple[set[str], set[str]]:
        """Return (revisions applied in the database, head revisions shipped with this gpuyard)."""
        with self._wrap_errors(), self.engine.connect() as conn:
            current: set[str] = set()
            if inspect(conn).has_table("alembic_version"):
                current = {r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))}
            conn.rollback()
        return current, shipped_heads()

    def migrate(self) -> None:
        """Apply every pending migration, once, even when several processes start together."""
        current, heads = self.revision_status()
        if current == heads:
            return
        with self._migration_lock():
            current, heads = self.revision_status()
            if current == heads:
                return
            from alembic import command

            with self.engine.connect() as conn:
                cfg = _alembic_config(self.engine)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "heads")
                conn.commit()

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        if self.is_sqlite:
            db_path = self.engine.url.database or ""
            lock_path = Path(db_path + ".migrate.lock") if db_path not in ("", ":memory:") else None
            if lock_path is None:
                yield
                return
            with open(lock_path, "w") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
        else:
            with self._wrap_errors(), self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                conn.commit()
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                    conn.commit()

    def dispose(self) -> None:
        """Close every pooled connection (after fork, or at the end of a test)."""
        self.engine.dispose()


_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def get_store(settings: Settings | None = None, url: str | None = None) -> Store:
    """The migrated state store for ``url`` (default: the configured database), one per process.

    Raises:
        StoreError: the database cannot be reached or migrated.
    """
    if url is None:
        settings = settings or load_settings()
        if settings.is_sqlite:
            settings.ensure_home()
        url = settings.database_url
    with _stores_lock:
        store = _stores.get(url)
        if store is None:
            store = Store(url)
            store.migrate()
            _stores[url] = store
        return store


def reset_store_cache() -> None:
    """Forget cached stores (tests that switch GPUYARD_HOME; after fork)."""
    with _stores_lock:
        for store in _stores.values():
            store.dispose()
        _stores.clear()
