"""Fixtures of the API tests: the app on a real uvicorn server (127.0.0.1) with every log record kept."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from tests.waiting import free_port


@dataclass
class LiveApi:
    """The API at ``url``, its admin token, and every log line written while it ran."""

    url: str
    home: Path
    admin_token: str
    records: list[str] = field(default_factory=list)

    def get(self, path: str, token: str | None = None, **kw: object) -> httpx.Response:
        """GET with ``Authorization: Bearer token`` (none when token is None)."""
        return httpx.get(self.url + path, headers=_auth(token), timeout=10, **kw)  # type: ignore[arg-type]

    def post(self, path: str, token: str | None = None, **kw: object) -> httpx.Response:
        """POST with ``Authorization: Bearer token`` (none when token is None)."""
        return httpx.post(self.url + path, headers=_auth(token), timeout=10, **kw)  # type: ignore[arg-type]


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token is not None else {}


class _Keep(logging.Handler):
    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.out = out
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(self.format(record))


@pytest.fixture
def live_api(gpuyard_home: Path, request: pytest.FixtureRequest) -> Iterator[LiveApi]:
    """create_app over a job service (teams research and vision, 1 fake GPU) on uvicorn at debug level.

    Every record of every logger (uvicorn's access log included) is captured into ``records``. Indirect
    parametrization passes keyword arguments to create_app (e.g. ``{"max_body_bytes": 1024}``).
    """
    import uvicorn

    from gpuyard.api.app import create_app
    from gpuyard.scheduler.setup import build_service

    records: list[str] = []
    handler = _Keep(records)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    # An in-process uvicorn.Config built with its default log_config (an earlier test in this worker)
    # leaves uvicorn's loggers with their own handlers and propagate=False: the access log would
    # never reach the root handler. Each record goes to the root here, restored afterwards.
    uv_loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    uv_saved = [(lg, lg.propagate, lg.handlers[:]) for lg in uv_loggers]
    for lg in uv_loggers:
        lg.propagate = True
        lg.handlers.clear()
    service = build_service(teams={"research": 1.0, "vision": 1.0}, fake_gpus=1, cpus=2, grace_s=1.0)
    app = create_app(jobs=service, **getattr(request, "param", {}))
    port = free_port()  # below the ephemeral range (tests.waiting)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="debug", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    stop = threading.Event()
    loop = threading.Thread(target=service.run, args=(stop,), daemon=True)
    loop.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    token = (gpuyard_home / "token").read_text().strip()
    try:
        yield LiveApi(f"http://127.0.0.1:{port}", gpuyard_home, token, records)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        stop.set()
        service.wake.set()
        loop.join(timeout=5)
        for pid_file in gpuyard_home.glob("jobs/*/attempt-*.pid"):  # no job outlives the test
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        service.executor.close()
        root.removeHandler(handler)
        root.setLevel(old_level)
        for lg, propagate, handlers in uv_saved:
            lg.propagate = propagate
            lg.handlers[:] = handlers
