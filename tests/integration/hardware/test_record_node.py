"""`gpuyard hw` records the inventory in the `nodes` table (SQLite and PostgreSQL), and starts light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.store.db import get_store, reset_store_cache
from gpuyard.store.tables.core import NodeRow

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgresql"])
def store_env(request: pytest.FixtureRequest, gpuyard_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point gpuyard at SQLite in an isolated home, or at a fresh PostgreSQL database."""
    if request.param == "postgresql":
        url = str(request.getfixturevalue("pg_url"))
        monkeypatch.setenv("GPUYARD_DATABASE_URL", url)
        return url
    return f"sqlite:///{gpuyard_home / 'gpuyard.db'}"


def _hw(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["hw", *args])
    assert (exit_info.value.code or 0) == 0
    return json.loads(capsys.readouterr().out)


def test_hw_upserts_the_node_row(store_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    first = _hw(["--json"], capsys)
    host = first["node"]["hostname"]
    store = get_store(url=store_env)
    with store.read() as s:
        row = s.get(NodeRow, host)
        assert row is not None
        assert row.inventory == first and row.health == first["node"]["health"]
        first_update = row.updated_at
    second = _hw(["--json"], capsys)
    with store.read() as s:
        rows = s.query(NodeRow).all()
        assert [r.hostname for r in rows] == [host]  # upsert by hostname, never a second row
        assert rows[0].inventory["node"]["probed_at"] == second["node"]["probed_at"]
        assert rows[0].updated_at >= first_update
    reset_store_cache()


def test_no_record_leaves_the_store_alone(store_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    _hw(["--json", "--no-record"], capsys)
    store = get_store(url=store_env)
    with store.read() as s:
        assert s.query(NodeRow).count() == 0
    reset_store_cache()


def test_record_inventory_of_a_replayed_node(store_env: str, tmp_path: Path) -> None:
    # Library path the scheduler uses: record a (fixture) inventory and read it back by host.
    from gpuyard.hardware.fake import FakeNvml, load_description, write_host_tree
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.record import record_inventory, recorded_nodes
    from gpuyard.hardware.sysfs import HostRoots

    fixture = Path(__file__).parents[2] / "unit" / "hardware" / "fixtures" / "h100_hgx.json"
    desc = load_description(fixture)
    desc["nvml"]["gpus"][6]["clock_event_reasons"] = 0x40
    roots = HostRoots.under(write_host_tree(desc, tmp_path))
    inv = probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname="hgx-07")
    record_inventory(inv)
    nodes = recorded_nodes()
    assert [n["hostname"] for n in nodes] == ["hgx-07"] and nodes[0]["health"] == "fail"
    assert nodes[0]["inventory"]["node"]["accelerators"][6]["health"] == "fail"
    reset_store_cache()


def _record_many(url: str, times: int) -> None:
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.record import record_inventory

    inv = probe_node(frameworks=False, hostname="shared-host")
    store = get_store(url=url)
    for _ in range(times):
        record_inventory(inv, store)


def test_concurrent_recorders_of_one_host_all_succeed(store_env: str) -> None:
    # Two processes upsert the same hostname at once: no "database is locked", no duplicate key.
    import multiprocessing as mp

    get_store(url=store_env)  # migrate once, up front
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(store_env, 10)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    with get_store(url=store_env).read() as s:
        assert [r.hostname for r in s.query(NodeRow).all()] == ["shared-host"]
    reset_store_cache()


def test_cli_start_up_does_not_import_torch(gpuyard_home: Path) -> None:
    code = (
        "import sys\n"
        "from gpuyard.cli.main import main\n"
        "try:\n    main(['hw', '--json', '--no-record'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
    )
    env = {**os.environ, "GPUYARD_HOME": str(gpuyard_home)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)
    assert proc.stderr.strip().splitlines()[-1] == "NO-TORCH"
