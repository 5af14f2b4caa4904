"""An idle kept-alive connection is closed by the connection guard, with a 408 a client can read before
it reuses the connection, never silently by uvicorn's own keep-alive timer (5 s by default: the age at
which httpx still reuses a pooled connection, so a request sent as the server closed was reset).

A real uvicorn server on loopback, in a thread, served as every guarded gpuyard server is
(:func:`gpuyard.connections.guarded_uvicorn`), its header timeout (6 s) above uvicorn's default.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from gpuyard.connections import ConnectionGuard, guarded_uvicorn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def test_an_idle_kept_alive_connection_gets_the_guards_408_not_a_silent_close() -> None:
    import uvicorn

    guard = ConnectionGuard(max_connections=16, per_address=8, reserve=2, header_timeout_s=6)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(**guarded_uvicorn(_app, guard), lifespan="off", log_level="warning", log_config=None)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
            assert thread.is_alive(), "the server did not start"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while b"{}" not in got:
                got += c.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
            # Now idle: read until the server closes the connection.
            after = b""
            while chunk := c.recv(4096):
                after += chunk
        assert after.startswith(b"HTTP/1.1 408"), after[:80]
        assert b"request headers not received within 6 s" in after
    finally:
        server.should_exit = True
        thread.join(30)
