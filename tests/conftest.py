"""Shared fixtures: an isolated GPUYARD_HOME, and a private PostgreSQL server for store tests."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

# Property tests assert what they generate, never how fast: no per-example deadline, and no health
# check that fails a test because generating its inputs was slow on a loaded machine.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("gpuyard", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("gpuyard")
except ImportError:  # hypothesis is in the dev extra; without it no property test runs
    pass


# `make test` runs the suite on pytest-xdist workers, one test file at a time per worker, handed out in
# collection order (`--dist loadfile --no-loadscope-reorder`). Files that start processes and servers
# (minutes in all, up to a minute and a half each) go first; the many short unit files come last and fill
# whichever worker finishes first, so no worker is left alone with a long file at the end. The Slurm
# module goes first of all: most of its time is a wait for Slurm's own time limit, which other files'
# work then fills.
_FILE_ORDER = ("integration/slurm", "multiproc", "integration", "security", "browser", "gpu", "unit")


def _file_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    for rank, prefix in enumerate(_FILE_ORDER):
        if path.startswith(f"tests/{prefix}/"):
            return rank
    return len(_FILE_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_file_rank)  # stable: each file keeps its own order


@pytest.fixture(scope="session", autouse=True)
def _no_user_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test writes to the user's ~/.gpuyard or talks to a gpuyard server it did not start.

    Training records runs in the state store by default and ``deploy --device auto`` asks
    GPUYARD_SERVER for GPUs: without this, a test that forgets ``gpuyard_home`` would use the real
    ones. Tests that need a home of their own still take the ``gpuyard_home`` fixture.
    """
    saved = {k: os.environ.get(k) for k in ("GPUYARD_HOME", "GPUYARD_SERVER")}
    os.environ["GPUYARD_HOME"] = str(tmp_path_factory.mktemp("session-home"))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        os.environ["GPUYARD_SERVER"] = f"http://127.0.0.1:{s.getsockname()[1]}"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def gpuyard_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh GPUYARD_HOME (SQLite + local artifacts) for one test; stores are re-opened inside it."""
    from gpuyard.store.db import reset_store_cache

    home = tmp_path / "home"
    monkeypatch.setenv("GPUYARD_HOME", str(home))
    for var in ("GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS"):
        monkeypatch.delenv(var, raising=False)
    reset_store_cache()
    yield home
    reset_store_cache()


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (tests.waiting.free_port)."""
    from tests.waiting import free_port as pick

    return pick()


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root: run the server as the `postgres` user when we are root.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A private PostgreSQL server on 127.0.0.1 (initdb + pg_ctl in a temp dir); yields its base URL.

    Skips when PostgreSQL is not installed, except under CI=true, where it fails.
    """
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        msg = "PostgreSQL (initdb, pg_ctl) is not installed; .ci/run installs it"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    root = Path(tempfile.mkdtemp(prefix="gpuyard-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = _free_port()
    subprocess.run(
        _as_postgres([initdb, "-A", "trust", "-U", "postgres", "-D", str(data), "--no-sync"]),
        check=True,
        capture_output=True,
    )
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off -c max_connections=200"
    subprocess.run(
        _as_postgres(
            [pg_ctl, "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "-t", "60", "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]),
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the private server, dropped after the test."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = postgres_server.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{postgres_server}/{name}"
    from gpuyard.store.db import reset_store_cache

    reset_store_cache()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
