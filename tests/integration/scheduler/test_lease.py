"""The scheduler lease: two job services on one store (SQLite and PostgreSQL), only one schedules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuyard.errors import ConflictError
from gpuyard.scheduler.service import JobService
from gpuyard.scheduler.spec import JobSpec
from gpuyard.store.db import reset_store_cache

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _job(name: str, marker: Path) -> JobSpec:
    code = "import os, sys; open(sys.argv[1], 'a').write(os.environ['GPUYARD_JOB_ID'] + '\\n')"
    return JobSpec.model_validate(
        {"name": name, "command": [sys.executable, "-c", code, str(marker)], "resources": {"gpus": 1}}
    )


def _only_one_schedules(make_service: Callable[..., JobService], tmp_path: Path) -> None:
    first, second = make_service(), make_service()
    marker = tmp_path / "starts.txt"
    ids = [int(first.submit(_job(f"j{i}", marker))["id"]) for i in range(2)]
    ids += [int(second.submit(_job(f"k{i}", marker))["id"]) for i in range(2)]

    def all_done() -> bool:
        first.tick()
        second.tick()
        return all(first.get(i)["state"] == "succeeded" for i in ids)

    wait_for(all_done, timeout=60)
    assert first.lease.held and not second.lease.held
    # Every job started exactly once, by the holder, though both services ticked all along.
    assert sorted(int(x) for x in marker.read_text().split()) == ids
    assert all(first.get(i)["attempts"] == 1 for i in ids)
    with pytest.raises(ConflictError, match=rf"pid {os.getpid()}"):
        second.recover()  # the holder's running jobs are not orphans to the other service
    first.lease.release()  # a clean stop frees the lease at once
    second.tick()
    assert second.lease.held
    second.lease.release()


def _takeover_after_holder_dies(
    make_service: Callable[..., JobService], home: Path, env: dict[str, str]
) -> None:
    # A holder in another process on this host, killed with -9: its lease is long (300 s) but its pid
    # is gone, so the next service takes over at once instead of waiting for the expiry.
    code = (
        "import sys, time\n"
        "from gpuyard.store import get_store\n"
        "from gpuyard.scheduler.lease import SchedulerLease\n"
        "lease = SchedulerLease(get_store(), role='server', ttl_s=300)\n"
        "assert lease.acquire() is None\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        env={**os.environ, **env, "GPUYARD_HOME": str(home)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
        service = make_service()
        with pytest.raises(ConflictError, match=rf"gpuyard server pid {proc.pid}"):
            service.recover()
        service.tick()
        assert not service.lease.held
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    service.lease._renewed = None  # renew at the next tick rather than a third of the ttl later
    assert service.recover() == {"adopted": 0, "requeued": 0}
    current = service.lease.current()
    assert service.lease.held and current is not None and current.pid == os.getpid()
    service.lease.release()


def _takeover_after_expiry(make_service: Callable[..., JobService]) -> None:
    # The holder stops renewing (hung, or on another host): only the expiry frees the lease.
    holder, waiting = make_service(lease_ttl_s=0.5), make_service()
    holder.tick()
    assert holder.lease.held
    waiting.tick()
    assert not waiting.lease.held
    wait_for(lambda: waiting.tick() or waiting.lease.held, timeout=10)
    # The old holder learns it lost the lease at its next renewal and stops scheduling.
    wait_for(lambda: holder.tick() or not holder.lease.held, timeout=10)
    assert not holder.lease.held


def test_sqlite_two_services_only_one_schedules(
    make_service: Callable[..., JobService], tmp_path: Path
) -> None:
    _only_one_schedules(make_service, tmp_path)


def test_sqlite_takeover_after_holder_killed_and_after_expiry(
    make_service: Callable[..., JobService], gpuyard_home: Path
) -> None:
    _takeover_after_holder_dies(make_service, gpuyard_home, {})
    _takeover_after_expiry(make_service)


def test_postgres_two_services_and_takeover(
    pg_url: str,  # first: the database must outlive make_service's clean-up
    make_service: Callable[..., JobService],
    gpuyard_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUYARD_DATABASE_URL", pg_url)
    reset_store_cache()
    _only_one_schedules(make_service, tmp_path)
    _takeover_after_holder_dies(make_service, gpuyard_home, {"GPUYARD_DATABASE_URL": pg_url})
    _takeover_after_expiry(make_service)
