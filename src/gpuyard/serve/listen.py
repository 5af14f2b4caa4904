"""A model server's listening socket, its URL, and the thread that reports it ready."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from gpuyard.errors import ConfigError

log = logging.getLogger("gpuyard.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (inheritable, so replica processes can accept on it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (this machine's name when it listens on every interface).

    A deployment placed on another node by the scheduler records this URL: ``0.0.0.0`` would send
    its clients to their own machine.
    """
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()  # getfqdn() answers 'localhost' on many hosts
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def watch_ready(url: str, callback: Any, expect: int = 1, timeout_s: float = 300.0) -> None:
    """In a daemon thread: poll ``/ready`` until it answers 200 ``expect`` times in a row, then call back."""

    def poll() -> None:
        import httpx

        deadline, streak = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline and streak < expect * 2:
            try:  # a fresh connection each time: the kernel may hand it to any replica
                streak = streak + 1 if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200 else 0
            except httpx.HTTPError:
                streak = 0
            if streak < expect * 2:
                time.sleep(0.1)
        if streak >= expect * 2:
            try:
                callback()
            except Exception as exc:  # a store hiccup must not stop the server from serving
                log.warning("could not record readiness: %s", exc)

    threading.Thread(target=poll, name="gpuyard-ready", daemon=True).start()
