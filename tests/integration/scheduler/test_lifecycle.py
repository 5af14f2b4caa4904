"""Server lifecycle: SIGTERM is a clean stop, a zombie holder is dead, and end times survive a restart."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import psutil
import pytest

from gpuyard.scheduler.client import JobClient
from gpuyard.scheduler.lease import SchedulerLease
from gpuyard.scheduler.service import JobService
from gpuyard.scheduler.spec import parse_spec
from gpuyard.store import get_store

from .conftest import ServerStarter, wait_for

pytestmark = pytest.mark.integration


def test_sigterm_stops_the_server_cleanly_and_gives_the_lease_back(server: ServerStarter) -> None:
    proc, _ = server()
    lease = SchedulerLease(get_store())
    wait_for(lambda: (cur := lease.current()) is not None and cur.pid == proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    # Released, not left to expire: the next server starts at once (as after Ctrl-C).
    assert lease.current() is None
    proc2, _ = server()
    assert proc2.poll() is None


def test_an_exited_unreaped_holder_is_not_taken_for_a_live_one(
    make_service: Callable[..., JobService], gpuyard_home: Path
) -> None:
    # The holder takes a long lease and exits without releasing it; its parent (this test) does not
    # reap it, so its pid still exists, as a zombie.
    code = (
        "import os\n"
        "from gpuyard.store import get_store\n"
        "from gpuyard.scheduler.lease import SchedulerLease\n"
        "assert SchedulerLease(get_store(), role='server', ttl_s=300).acquire() is None\n"
        "os._exit(0)\n"
    )
    env = {**os.environ, "GPUYARD_HOME": str(gpuyard_home)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, timeout=60)
        held = SchedulerLease(get_store()).current()
        assert held is not None and held.pid == proc.pid
        service = make_service()
        assert service.recover() == {"adopted": 0, "requeued": 0}  # no ConflictError naming the zombie
        assert service.lease.held
        service.lease.release()
    finally:
        proc.wait()


def test_a_job_that_ended_while_no_server_ran_keeps_its_end_time(
    server: ServerStarter, gpuyard_home: Path, tmp_path: Path
) -> None:
    proc, url = server()
    client = JobClient(url)
    release = tmp_path / "go"
    code = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
    job = client.submit(parse_spec({"name": "ends", "command": [sys.executable, "-c", code, str(release)]}))
    wait_for(lambda: client.get(job["id"])["state"] == "running")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    release.touch()  # the job ends while no server runs
    exit_files = lambda: list(gpuyard_home.glob(f"jobs/{job['id']}/attempt-*.exit"))  # noqa: E731
    wait_for(lambda: bool(exit_files()), timeout=30)
    ended = datetime.fromtimestamp(exit_files()[0].stat().st_mtime, timezone.utc)
    restarted = datetime.now(timezone.utc)
    _, url = server()
    client = JobClient(url)
    wait_for(lambda: client.get(job["id"])["state"] == "succeeded", timeout=30)
    doc = client.get(job["id"])
    finished = datetime.fromisoformat(doc["finished_at"])
    assert finished < restarted  # before: the moment the new server reaped it
    assert abs((finished - ended).total_seconds()) < 1.0
    events = client.events(job["id"])
    assert datetime.fromisoformat(events[-1]["at"]) == finished


def test_health_config_is_checked_before_the_server_starts(gpuyard_home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "health.yaml"
    bad.write_text("interval_s: -1\n")
    argv = [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", "1", "--health-config", str(bad)]
    argv += ["--job-user", getpass.getuser()]  # not the job-user check, which a root server runs first
    out = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)}
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and f"health config {bad}: " in lines[0], out.stderr
    bad.write_text("interval_s: [1\n")
    out = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)}
    )
    assert out.returncode == 2 and f"{bad}:2:1: not valid YAML" in out.stderr, out.stderr


def test_the_startup_line_says_whether_node_health_is_checked(server: ServerStarter, tmp_path: Path) -> None:
    server()  # pretended GPUs (--gpus 1): nothing real to check
    log = (tmp_path / "server0.log").read_text()
    assert "no node health checks" in log, log
