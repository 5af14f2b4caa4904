"""The request-body cap over real HTTP: 413 before the body is read, 408 for a body that trickles."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from gpuyard.limits import DEFAULT_MAX_BODY_BYTES

from .conftest import LiveApi

pytestmark = pytest.mark.integration

SMALL = {"max_body_bytes": 64 * 1024, "body_timeout_s": 1.0}


def _connect(live: LiveApi) -> socket.socket:
    url = urlsplit(live.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=20)
    return sock


def _head(live: LiveApi, length: int | None, path: str = "/jobs") -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {urlsplit(live.url).netloc}",
        f"Authorization: Bearer {live.admin_token}",
        "Content-Type: application/json",
    ]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """Status and JSON body of the one response on ``sock`` (read until the server closes)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_declared_length_over_the_cap_is_413_before_any_body_is_sent(live_api: LiveApi) -> None:
    with _connect(live_api) as sock:
        sock.sendall(_head(live_api, 1 << 40))  # one TiB announced, not a byte of it sent
        status, body = _response(sock)  # the server answers and closes: it waits for nothing
    assert status == 413
    assert body["detail"] == (
        f"request body: {1 << 40} bytes; this server takes at most {DEFAULT_MAX_BODY_BYTES} bytes "
        "(gpuyard server --max-body-mb)"
    )
    assert live_api.get("/health").status_code == 200


@pytest.mark.parametrize("live_api", [SMALL], indirect=True)
def test_a_chunked_body_is_read_only_up_to_the_cap(live_api: LiveApi) -> None:
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"name": "x", "command": ["'
        while sent < 100 * SMALL["max_body_bytes"]:  # a client that would never stop
            sent += 8192
            yield b"a" * 8192

    try:
        resp = httpx.post(
            live_api.url + "/jobs",
            content=endless(),
            headers={"Authorization": f"Bearer {live_api.admin_token}"},
            timeout=20,
        )
        assert resp.status_code == 413 and "at most 65536" in resp.json()["detail"]
    except httpx.WriteError:  # the server answered 413 and closed while the client was still sending
        pass
    assert sent < 100 * SMALL["max_body_bytes"]
    # A body under the cap is served as usual.
    ok = live_api.post("/jobs", live_api.admin_token, json={"name": "x", "command": ["true", "a" * 60_000]})
    assert ok.status_code == 201


@pytest.mark.parametrize("live_api", [SMALL], indirect=True)
def test_a_slow_body_is_cut_off_with_408_and_holds_nothing(live_api: LiveApi) -> None:
    with _connect(live_api) as slow, _connect(live_api) as never:
        slow.sendall(_head(live_api, 1000) + b'{"name": "slow"')  # 15 of 1000 bytes, then nothing
        never.sendall(_head(live_api, None) + b'5\r\n{"a":\r\n')  # a chunked body that never ends
        # While both hang, the server answers everyone else.
        assert live_api.get("/health").status_code == 200
        assert live_api.get("/jobs", live_api.admin_token).status_code == 200
        for sock in (slow, never):
            status, body = _response(sock)  # the server's timeout (1 s) ends the wait, not ours (20 s)
            assert status == 408 and "not received within 1 s" in body["detail"]
    assert live_api.get("/jobs", live_api.admin_token).json() == []  # nothing half-submitted


def test_the_default_cap_refuses_a_5_mib_spec_and_takes_a_large_allowed_one(live_api: LiveApi) -> None:
    token = live_api.admin_token
    big = httpx.post(
        live_api.url + "/jobs",
        content=b" " * (5 << 20),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert big.status_code == 413
    allowed = live_api.post("/jobs", token, json={"name": "x", "command": ["true", *["a" * 100_000] * 10]})
    assert allowed.status_code == 201
