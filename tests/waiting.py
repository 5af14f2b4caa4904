"""Waiting for a condition in tests: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 30.0, every: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy and return that; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def ensure_user(name: str) -> str:
    """The system user ``name``, created when missing (the tests run as root); safe when several pytest
    workers (pytest-xdist) create the same user at once: useradd's 'already exists' (9) counts as done,
    and its 'cannot lock /etc/passwd' (10) is retried until the other creator is through."""
    import pwd
    import subprocess

    def created() -> bool:
        try:
            pwd.getpwnam(name)
            return True
        except KeyError:
            pass
        done = subprocess.run(
            ["useradd", "--system", "--no-create-home", name], capture_output=True, text=True
        )
        if done.returncode not in (0, 9, 10):
            raise AssertionError(f"useradd {name} failed ({done.returncode}): {done.stderr.strip()}")
        return done.returncode != 10

    wait_for(created, timeout=30, every=0.1)
    return name


# Ports the kernel never hands out as the source port of an outgoing connection (Linux's default
# ip_local_port_range starts at 32768): a flood test's thousands of client connections on another
# worker can then not take the port a server is about to bind, as they could take one from bind(0).
_PORTS = (20000, 32767)


def _worker_ports(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's own slice of [low, high]: two workers never pick the same port, so
    one worker's server cannot answer another's health check in the window between the pick and the
    bind (the whole range outside xdist)."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    except ValueError:
        return low, high
    if count <= 1 or not 0 <= index < count:
        return low, high
    width = (high - low + 1) // count
    return low + index * width, low + (index + 1) * width - 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the ephemeral range, from this
    worker's own slice of it."""
    import random
    import socket

    low, high = _PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            high = min(high, int(fh.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    low, high = _worker_ports(low, high)
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high} after 200 tries")
