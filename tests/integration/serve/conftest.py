"""Fixtures: a GPUYARD_HOME with example models registered, and `gpuyard serve` running on a free port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

READY_TIMEOUT_S = 90


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (tests.waiting.free_port)."""
    from tests.waiting import free_port as pick

    return pick()


# The key every test server is started with ($GPUYARD_SERVE_KEY); clients send it as a bearer.
SERVE_KEY = "gyk_integration-tests-serve-key-0123456789"
AUTH = {"Authorization": f"Bearer {SERVE_KEY}"}


def kget(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    """``httpx.get`` with the test servers' key."""
    return httpx.get(url, headers={**AUTH, **(headers or {})}, **kwargs)


def kpost(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` with the test servers' key."""
    return httpx.post(url, headers={**AUTH, **(headers or {})}, **kwargs)


@dataclass
class Server:
    """A running `gpuyard serve` process."""

    url: str
    proc: subprocess.Popen[str]
    log: Path

    @property
    def http(self) -> httpx.Client:
        """A client that sends the server's key."""
        return httpx.Client(headers=AUTH, timeout=30)


@pytest.fixture(scope="module")
def serve_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A GPUYARD_HOME shared by one test module, with the example MLP registered as ``mlp``."""
    from gpuyard.store.db import reset_store_cache

    home = tmp_path_factory.mktemp("serve") / "home"
    keys = ("GPUYARD_HOME", "GPUYARD_DATABASE_URL", "GPUYARD_ARTIFACTS", "GPUYARD_SERVER")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["GPUYARD_HOME"] = str(home)
    # `deploy --device auto` asks the gpuyard server whether it has GPUs: never one outside the test.
    os.environ["GPUYARD_SERVER"] = f"http://127.0.0.1:{free_port()}"
    os.environ.pop("GPUYARD_DATABASE_URL", None)
    os.environ.pop("GPUYARD_ARTIFACTS", None)
    reset_store_cache()
    from gpuyard.serve.examples import register_example

    register_example("mlp", "mlp", in_features=8, hidden=16, classes=3)
    yield home
    reset_store_cache()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def start_server(home: Path, *args: str) -> Server:
    """Start `gpuyard serve ARGS --port 0` and wait until /ready answers 200."""
    log = home / f"serve-{time.monotonic_ns()}.log"
    fh = open(log, "w")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuyard.cli.main", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=fh,
        text=True,
        env={**os.environ, "GPUYARD_HOME": str(home), "GPUYARD_SERVE_KEY": SERVE_KEY},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving REF at URL (...)", printed once the socket is bound
    if "serving" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()}")
    url = line.split(" at ", 1)[1].split()[0]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return Server(url, proc, log)
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(5)


@pytest.fixture(scope="module")
def mlp_server(serve_home: Path) -> Iterator[Server]:
    """The example MLP served with a small, fast drift window."""
    server = start_server(
        serve_home,
        "mlp",
        "--max-batch",
        "16",
        "--drift-window",
        "300",
        "--drift-interval",
        "0.3",
        "--max-body-bytes",
        "65536",
    )
    yield server
    stop_server(server)
