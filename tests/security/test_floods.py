"""Floods a member could send at `gpuyard server`: idle and half-sent connections by the thousand, more
connections than an address may hold, and a disk filled to the last byte. The server must keep
answering /health, say what it refused in one line, and recover by itself."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.scheduler.conftest import SAME_USER, ServerStarter, free_port, wait_for

pytestmark = pytest.mark.security

FLOOD = 20_000  # idle connections held at once
HOLDERS = 4  # processes holding them (each under its own open-file limit)
HEALTH_TIMEOUT_S = 1.0  # /health must answer within this while the flood is held
WAIT_FOR_FILE = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"


def _hold(port: int, count: int, out: Any, stop: Any) -> None:
    """Open ``count`` connections to ``port`` without sending a byte; report how many were established
    (a refused or reset one is counted apart) and keep them open until ``stop``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        code = s.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            s.close()
            continue
        socks.append(s)
        sel.register(s, selectors.EVENT_WRITE)
    established = failed = 0
    deadline = time.monotonic() + 60
    while len(sel.get_map()) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            sock = key.fileobj
            sel.unregister(sock)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:  # type: ignore[union-attr]
                established += 1
            else:
                failed += 1
    out.put((established, failed))
    stop.wait(120)
    for s in socks:
        s.close()


def _health(url: str, timeout: float) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Guarded:
    """A `gpuyard server` with small connection limits, shared by this module's connection tests."""

    url: str
    port: int
    home: Path
    log: Path
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    """`gpuyard server --header-timeout 1.5 --max-connections-per-address 20` in a home of its own."""
    folder = tmp_path_factory.mktemp("guarded")
    home, log = folder / "home", folder / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = ["--gpus", "0", "--cpus", "1", "--header-timeout", "1.5", "--max-connections-per-address", "20"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", str(port), *options, *SAME_USER],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GPUYARD_HOME": str(home)},
        )

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        return _health(url, 1.0)

    try:
        wait_for(up, timeout=90, every=0.1)
        yield Guarded(url, port, home, log, proc)
    finally:
        proc.kill()
        proc.wait()


def test_20000_idle_connections_leave_health_answering(guarded: Guarded) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < FLOOD // HOLDERS + 100:
        pytest.skip(f"the open-file hard limit ({hard}) is below {FLOOD // HOLDERS + 100} per holder")
    proc, url, port = guarded.proc, guarded.url, guarded.port
    before = len(guarded.log.read_text().splitlines())
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    holders = [ctx.Process(target=_hold, args=(port, FLOOD // HOLDERS, out, stop)) for _ in range(HOLDERS)]
    for p in holders:
        p.start()
    try:
        counts = [out.get(timeout=90) for _ in holders]
        held = sum(c[0] for c in counts)
        assert held >= FLOOD, counts  # the kernel completed every handshake: all are held open
        # Once the server has taken the backlog in, /health answers within the bound, every time.
        wait_for(lambda: _health(url, 10.0), timeout=30)
        answered = [_health(url, HEALTH_TIMEOUT_S) for _ in range(10)]
        assert all(answered), answered
        assert proc.poll() is None
    finally:
        stop.set()
        for p in holders:
            p.join(timeout=30)
    log = "\n".join(guarded.log.read_text().splitlines()[before:])
    # What the guard did is a few summary lines, never a line per connection, and no traceback.
    lines = [ln for ln in log.splitlines() if "connections from 127.0.0.1" in ln]
    assert 1 <= len(lines) <= 20, log[-3000:]
    assert "Traceback" not in log and "Too many open files" not in log


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_half_sent_headers_are_cut_off_and_an_address_over_its_cap_gets_429_without_a_token(
    guarded: Guarded, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.auth import add_user, create_token
    from gpuyard.store.db import reset_store_cache

    monkeypatch.setenv("GPUYARD_HOME", str(guarded.home))
    reset_store_cache()
    url, port, gpuyard_home = guarded.url, guarded.port, guarded.home
    admin = (gpuyard_home / "token").read_text().strip()
    add_user("mallory", team="default")
    member, _ = create_token("mallory")
    # Half a request (no blank line after the headers), and a connection that sends nothing.
    half, idle = _connect(port), _connect(port)
    half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    for sock in (half, idle):
        answer = _read_all(sock, timeout=15)  # returns at the server's close (EOF), else empty
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"request headers not received within 1.5 s" in answer
        sock.close()
    # 20 connections without a token are the address's share; the 21st and later are in the reserve.
    share = [_connect(port) for _ in range(20)]
    try:
        over = _connect(port)
        over.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_all(over, timeout=10)
        assert answer.startswith(b"HTTP/1.1 429"), answer
        assert b"too many connections from 127.0.0.1" in answer and b"at most 20 per address" in answer
        over.close()
        # /health, an admin and a member's token get in: a token charges the connection to its team,
        # which holds none of the address's 20.
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/health").status_code == 200
            mine = client.get("/jobs", headers={"Authorization": f"Bearer {admin}"})
            assert mine.status_code == 200, mine.text
        with httpx.Client(base_url=url, timeout=5) as client:
            theirs = client.get("/jobs", headers={"Authorization": f"Bearer {member}"})
            assert theirs.status_code == 200, theirs.text
    finally:
        for sock in share:
            sock.close()
    # The share's connections gone, a client without a token is served again.
    wait_for(lambda: httpx.get(f"{url}/openapi.json", timeout=5).status_code == 200, timeout=15)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie its parent has not reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _fill(folder: Path) -> Path:
    """Write a file in ``folder`` until its disk is full (to the last page); return it."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_refuses_submissions_in_one_line_and_scheduling_recovers(
    small_home: Path, server: ServerStarter, tmp_path: Path
) -> None:
    _, url = server("--gpus", "0", "--cpus", "2", "--grace", "1")
    auth = {"Authorization": f"Bearer {(small_home / 'token').read_text().strip()}"}
    release = tmp_path / "release"
    waiting = {
        "name": "placed",
        "command": ["python3", "-c", WAIT_FOR_FILE, str(release)],
        "resources": {"gpus": 0},
    }
    with httpx.Client(base_url=url, headers=auth, timeout=10) as client:
        placed = client.post("/jobs", json=waiting).json()["id"]
        wait_for(lambda: client.get(f"/jobs/{placed}").json()["state"] == "running", timeout=30)
        log_path = tmp_path / "server0.log"
        before = len(log_path.read_text().splitlines())
        filler = _fill(small_home)
        refused = client.post("/jobs", json={"name": "late", "command": ["true"], "resources": {"gpus": 0}})
        assert refused.status_code == 507, refused.text
        detail = refused.json()["detail"]
        assert detail.startswith("disk full:") and str(small_home) in detail, detail
        release.touch()  # the placed job ends while the disk is full
        ended_at = time.time()
        (pid_file,) = (small_home / "jobs" / str(placed)).glob("attempt-*.pid")
        wait_for(lambda: _gone(int(pid_file.read_text())), timeout=60)  # its shim has exited
        # Scheduling goes on meanwhile: the server answers, reads work, the log stays short.
        for _ in range(40):  # 4 s or more: the server's loop sees the end meanwhile
            assert client.get("/health").status_code == 200
            assert client.get(f"/jobs/{placed}").status_code == 200
            time.sleep(0.1)
        ready = client.get("/ready").json()
        assert "MiB free" in ready["checks"]["disk"]
        space_at = time.time()
        filler.unlink()  # space returns
        done = wait_for(
            lambda: (
                (doc := client.get(f"/jobs/{placed}").json())["state"] not in ("running", "scheduled") and doc
            ),
            timeout=30,
        )
        # Its real end, not the moment space came back, and no signal it never got.
        assert "SIGKILL" not in (done["reason"] or ""), done
        if done["state"] != "succeeded":
            assert "disk" in done["reason"], done
        finished = datetime.fromisoformat(done["finished_at"]).replace(tzinfo=timezone.utc).timestamp()
        assert ended_at - 1 <= finished < space_at, (done["finished_at"], ended_at, space_at)
        # And new work runs again.
        late = client.post("/jobs", json={"name": "late", "command": ["true"], "resources": {"gpus": 0}})
        assert late.status_code == 201, late.text
        wait_for(lambda: client.get(f"/jobs/{late.json()['id']}").json()["state"] == "succeeded", timeout=30)
    during = log_path.read_text().splitlines()[before:]
    records = [i for i, ln in enumerate(during) if re.match(r"\d{4}-\d\d-\d\d ", ln)]
    with_traceback = [i for i in records if i + 1 < len(during) and during[i + 1].startswith("Traceback")]
    # A few records (the error, how often it repeated, the recovery), a traceback once, not per tick.
    assert len(records) <= 10, "\n".join(during[i] for i in records)
    assert len(with_traceback) <= 1, "\n".join(during[i] for i in records)
