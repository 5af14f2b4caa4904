"""Fixtures for scheduler integration tests: a job service on this machine, and a checkpointing job."""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from tests.waiting import wait_for

__all__ = ["ServerStarter", "free_port", "wait_for"]  # the tests of this folder import them from here

# Starts a `gpuyard server` with the options given (default: SERVER_OPTIONS); returns it and its URL.
ServerStarter = Callable[..., tuple["subprocess.Popen[bytes]", str]]
SERVER_OPTIONS = ("--gpus", "1", "--cpus", "1", "--team", "research=2", "--grace", "2")
# These tests' jobs write to the test's own folders: they run as the server's user (single-user mode)
# unless a test names --job-user itself (test_isolation.py runs them as the unprivileged job user).
SAME_USER = ("--job-user", getpass.getuser())

# A job that counts, checkpoints its counter on SIGTERM and exits with PREEMPTED (75); started again it
# resumes from the checkpoint. argv: CHECKPOINT_FILE STEPS [RELEASE_FILE]; with RELEASE_FILE its
# checkpoint takes until that file exists (a slow checkpoint, ended by the test).
CHECKPOINTING_JOB = r"""
import os, signal, sys, time
ckpt, steps = sys.argv[1], int(sys.argv[2])
release = sys.argv[3] if len(sys.argv) > 3 else None
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
print(f"start at {start}", flush=True)
state = {"i": start}
def on_term(*_):
    print("checkpointing", flush=True)
    while release and not os.path.exists(release):
        time.sleep(0.01)
    open(ckpt, "w").write(str(state["i"]))
    print(f"checkpointed at {state['i']}", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
while state["i"] < steps:
    time.sleep(0.05)
    state["i"] += 1
    if state["i"] % 5 == 0:
        print(f"step {state['i']}", flush=True)
print("finished", flush=True)
"""


@pytest.fixture
def job_script(tmp_path: Path) -> Path:
    """Path of the checkpointing job script."""
    path = tmp_path / "ckpt_job.py"
    path.write_text(CHECKPOINTING_JOB)
    return path


@pytest.fixture
def python() -> str:
    """The interpreter jobs run with."""
    return sys.executable


@pytest.fixture
def make_service(gpuyard_home: Path) -> Iterator[Callable[..., object]]:
    """Build JobServices on the local executor with fake GPUs; their jobs are killed at the end."""
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    made: list[JobService] = []

    def make(gpus: int = 2, cpus: int = 2, **config: object) -> JobService:
        node = NodeSpec("local", gpus, "fake-gpu" if gpus else "", "local", "local", cpus=cpus)
        defaults: dict[str, object] = {"tick_s": 0.05, "grace_s": 2.0, "min_run_s": 0.0}
        service = JobService(
            get_store(), [node], LocalExecutor(gpuyard_home / "jobs"), ServiceConfig(**{**defaults, **config})
        )  # type: ignore[arg-type]
        made.append(service)
        return service

    yield make
    for service in made:
        for doc in service.list_jobs():
            if doc["state"] == "running" and doc["spec"]:
                with contextlib.suppress(Exception):
                    service.cancel(doc["id"])
        for doc in service.list_jobs(state="running"):
            from sqlalchemy import select

            from gpuyard.store.tables.jobs import JobRow

            with service.store.read() as s:
                row = s.scalars(select(JobRow).where(JobRow.id == doc["id"])).one()
                if row.handle:
                    service.executor.stop(row.handle, kill=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (tests.waiting.free_port)."""
    from tests.waiting import free_port as pick

    return pick()


@pytest.fixture
def server(gpuyard_home: Path, tmp_path: Path) -> Iterator[ServerStarter]:
    """Start `gpuyard server` processes on one home and port (options: SERVER_OPTIONS unless given).

    Each start waits until /health answers (or fails with the server's log); all are killed at the end,
    and so are the process groups of jobs they left running.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    def start(*options: str) -> tuple[subprocess.Popen[bytes], str]:
        options = options or SERVER_OPTIONS
        if "--job-user" not in options:
            options = (*options, *SAME_USER)
        log_path = tmp_path / f"server{len(procs)}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuyard.cli.main",
                "server",
                "--port",
                str(port),
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)},
        )
        procs.append(proc)

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, log_path.read_text()
                return False

        wait_for(healthy, timeout=60, every=0.1)
        # A server that lost the bind exits: the answer came from another process on the port.
        assert proc.poll() is None, log_path.read_text()
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Kill whatever job process groups are left (their pid files are in the home).
    for pid_file in gpuyard_home.glob("jobs/*/attempt-*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
