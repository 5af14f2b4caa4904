"""The operator's view: /ready checks the database, /health says it checks liveness only, a failing
scheduling tick is logged once per distinct error, "not scheduling" is said once per holder, a full
disk is a 507 naming it, an exit lost to a full disk says so, and the dashboard's security headers."""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpuyard.errors import StoreError

pytestmark = pytest.mark.integration

WEB = Path(__file__).resolve().parents[3] / "src" / "gpuyard" / "web"


@pytest.fixture
def api(gpuyard_home: Path) -> Iterator[tuple[TestClient, Any, str]]:
    """The app over a job service (2 CPU slots, no GPU), a client, and the admin token."""
    from gpuyard.api.app import create_app
    from gpuyard.scheduler.setup import build_service

    service = build_service(teams={"research": 1.0}, fake_gpus=0, cpus=2, grace_s=1.0)
    with TestClient(create_app(jobs=service)) as client:
        yield client, service, (gpuyard_home / "token").read_text().strip()


def test_ready_fails_while_the_database_is_unreachable(
    api: tuple[TestClient, Any, str], tmp_path: Path
) -> None:
    from gpuyard.store.db import Store

    client, service, _ = api
    ok = client.get("/ready")
    assert ok.status_code == 200 and ok.json()["checks"]["database"] == "ok", ok.text
    store = service.store
    broken = tmp_path / "gpuyard.db"
    broken.mkdir()  # a folder where the database file should be: SQLite cannot open it
    service.store = Store(f"sqlite:///{broken}")
    try:
        down = client.get("/ready")
        assert down.status_code == 503, down.text
        assert down.json()["status"] == "unavailable"
        assert "unable to open database file" in down.json()["checks"]["database"]
        health = client.get("/health")  # liveness: still 200, and it says what it checks
        assert health.status_code == 200 and "liveness" in health.json()["checks"]
    finally:
        service.store.dispose()
        service.store = store
    assert client.get("/ready").status_code == 200


def test_a_full_disk_refuses_submissions_with_507_naming_it(
    api: tuple[TestClient, Any, str], monkeypatch: pytest.MonkeyPatch, gpuyard_home: Path
) -> None:
    import gpuyard.scheduler.service as service_module

    client, _, token = api
    spec = {"name": "j", "command": ["true"], "team": "research", "resources": {"gpus": 0}}
    real = service_module.free_bytes
    monkeypatch.setattr(service_module, "free_bytes", lambda path: 4096)
    r = client.post("/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 507, r.text
    detail = r.json()["detail"]
    assert detail.startswith("disk full:") and str(gpuyard_home) in detail and "\n" not in detail
    monkeypatch.setattr(service_module, "free_bytes", real)
    r = client.post("/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text


def test_disk_full_errors_from_anywhere_become_one_line() -> None:
    from gpuyard.api.app import disk_full_detail

    sqlite_full = sqlite3.OperationalError("database or disk is full")
    assert disk_full_detail(sqlite_full) is not None
    wrapped = StoreError("state store sqlite:////h/gpuyard.db: database or disk is full")
    assert "state store sqlite:////h/gpuyard.db" in (disk_full_detail(wrapped) or "")
    nospace = OSError(errno.ENOSPC, "No space left on device", "/h/jobs/3/attempt-1.log")
    assert "/h/jobs/3/attempt-1.log" in (disk_full_detail(nospace) or "")
    try:
        try:
            raise nospace
        except OSError as exc:
            raise RuntimeError("while writing") from exc
    except RuntimeError as outer:
        assert disk_full_detail(outer) is not None  # found through the cause
    assert disk_full_detail(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full_detail(StoreError("state store x: database is locked")) is None


def test_a_failing_tick_is_logged_once_per_distinct_error_with_backoff(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuyard.scheduler.service as service_module

    now = [1000.0]
    monkeypatch.setattr(service_module.time, "monotonic", lambda: now[0])
    errors = service_module.TickErrors()
    caplog.set_level(logging.INFO, logger="gpuyard.scheduler.service")
    full = StoreError("state store sqlite:////h/gpuyard.db: database or disk is full")
    for _ in range(50):  # 10 s of failing ticks, five a second
        errors.failed(full)
        now[0] += 0.19
    records = [r for r in caplog.records if r.name == "gpuyard.scheduler.service"]
    assert len(records) == 1 and records[0].exc_info is not None  # one line, its traceback once
    assert "database or disk is full" in records[0].getMessage()
    now[0] += 1.0
    errors.failed(full)  # past 10 s: said again, with how often, without a traceback
    records = [r for r in caplog.records if r.name == "gpuyard.scheduler.service"]
    assert len(records) == 2 and records[1].exc_info is None
    assert "still failing (50 more times" in records[1].getMessage()
    other = StoreError("state store x: database is locked")
    errors.failed(other)  # a new error: its own line and traceback
    errors.failed(full)  # the first again: a line, no second traceback
    records = [r for r in caplog.records if r.name == "gpuyard.scheduler.service"]
    assert [r.exc_info is not None for r in records[2:]] == [True, False]
    assert errors.delay(0.2) == errors.MAX_DELAY_S  # failing: the loop waits longer between ticks
    errors.succeeded()
    assert "recovered after 53 failed ticks" in caplog.records[-1].getMessage()
    assert errors.delay(0.2) == 0.2


def test_not_scheduling_is_said_once_per_holder(gpuyard_home: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gpuyard.scheduler.service import JobService
    from gpuyard.scheduler.setup import build_service

    base = build_service(fake_gpus=0, cpus=1)
    short = replace(base.config, lease_ttl_s=0.3)  # renewed every 0.1 s: the holder's expiry moves
    holder = JobService(base.store, base.nodes, base.executor, short, role="server")
    other = JobService(base.store, base.nodes, base.executor, short)
    caplog.set_level(logging.WARNING, logger="gpuyard.scheduler.service")
    import time

    end = time.monotonic() + 1.0
    renewals = 0
    while time.monotonic() < end:
        before = holder.lease._renewed
        assert holder.holds_lease()
        renewals += holder.lease._renewed != before
        assert not other.holds_lease()
        time.sleep(0.02)
    assert renewals >= 3  # the holder's lease (and its message's expiry) changed meanwhile
    said = [r.getMessage() for r in caplog.records if "not scheduling" in r.getMessage()]
    assert len(said) == 1, said
    holder.lease.release()


def test_an_exit_lost_to_a_full_disk_is_not_blamed_on_a_signal(gpuyard_home: Path) -> None:
    from gpuyard.scheduler.executors.base import ExitStatus
    from gpuyard.scheduler.setup import build_service
    from gpuyard.scheduler.spec import JobSpec

    service = build_service(fake_gpus=0, cpus=1, grace_s=1.0)
    job = service.submit(JobSpec(name="lost", command=["sleep", "30"], resources={"gpus": 0}))
    service.tick()
    running = service.get(job["id"])
    assert running["state"] == "running", running
    with service.store.read() as s:
        from gpuyard.store.tables.jobs import JobRow

        handle = dict(s.get(JobRow, job["id"]).handle)
    service.executor.stop(handle, kill=True)  # the real process goes; its end is what we stage below
    Path(handle["exit_file"] + ".tmp").write_text("")  # the shim's write of the exit code failed
    service.executor.poll = lambda h: ExitStatus(code=None, killed=True)  # type: ignore[method-assign]
    service.tick()
    done = service.get(job["id"])
    assert done["state"] == "failed"
    assert "exit code not recorded: the disk at" in done["reason"] and "SIGKILL" not in done["reason"]


def test_the_dashboard_sends_a_strict_policy_and_every_response_nosniff_and_no_framing(
    api: tuple[TestClient, Any, str],
) -> None:
    client, _, _ = api
    for path in ("/", "/static/app.js", "/static/app.css"):
        r = client.get(path)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "style-src 'self'" in csp and "default-src 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    for path in ("/health", "/jobs"):  # JSON answers, a 401 included
        r = client.get(path)
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"


def test_the_dashboard_markup_has_no_inline_script_style_or_handler() -> None:
    html = (WEB / "templates" / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "inline <script>"
    assert "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html), "inline event handler"
    for js in (WEB / "static").glob("*.js"):
        text = js.read_text()
        # Markup built in the scripts: no style attribute (blocked by the policy) and no handler.
        assert not re.search(r"""\sstyle=["'$]""", text), js.name
        assert not re.search(r"""<[a-z][^>]*\son[a-z]+=""", text), js.name
        assert "eval(" not in text and "new Function" not in text, js.name
