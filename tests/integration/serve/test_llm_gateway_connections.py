"""The gateway's connections as a process of its own serves them (the model servers' connection guard,
gpuyard.connections): clients that send half a request head and idle, or dribble it, are answered
408 and closed once the header timeout passes, while an ordinary client is answered all along; a
kept-alive connection's next head is due within the same timeout."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from tests.integration.serve.fake_replica import AUTH, KEY, FakeReplica, GatewayProcess
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HEADER_TIMEOUT_S = 2.0
SLOW = 40
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    replica = FakeReplica()
    folder = tmp_path_factory.mktemp("gateway")
    g = GatewayProcess(replica.port, folder, header_timeout_s=HEADER_TIMEOUT_S)
    yield g
    g.stop()


def _answer_and_close(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a generous 120 s bound)."""
    s.settimeout(120)
    got = b""
    while True:
        data = s.recv(65536)
        if not data:
            return got
        got += data


def _complete(prompt: str = "stream") -> bytes:
    return b'{"model": "m", "prompt": "%s", "max_tokens": 8, "stream": true}' % prompt.encode()


def test_half_sent_heads_are_answered_408_and_closed_while_others_are_served(
    gateway: GatewayProcess,
) -> None:
    url = gateway.url
    slow = [socket.create_connection(("127.0.0.1", gateway.port), timeout=30) for _ in range(SLOW)]
    for s in slow:
        s.sendall(HALF_HEAD)
    # One more that keeps dribbling header lines: sending does not extend its deadline.
    dribbler = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
    dribbler.sendall(HALF_HEAD)
    stop = threading.Event()

    def dribble() -> None:
        n = 0
        while not stop.wait(0.2):  # a slow client's pace, not a wait for a condition
            try:
                dribbler.sendall(b"X-Slow-%d: 1\r\n" % n)
            except OSError:
                return  # the gateway closed it
            n += 1

    pacer = threading.Thread(target=dribble, daemon=True)
    pacer.start()
    answers: list[bytes] = []
    body = {"model": "m", "prompt": "stream", "max_tokens": 8, "stream": True}
    try:
        # An ordinary client is answered while the slow ones hold their connections.
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(3):
                r = client.post("/v1/completions", json=body, headers=AUTH)
                assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        answers = [_answer_and_close(s) for s in [*slow, dribbler]]
    finally:
        stop.set()
        for s in [*slow, dribbler]:
            s.close()
    assert len(answers) == SLOW + 1
    for got in answers:
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert b"request headers not received within 2 s" in got
    pacer.join(30)
    # The gateway said what it did, in one line for the address, not one per connection.
    wait_for(lambda: "closed without complete headers (408)" in gateway.log_tail(50), timeout=60)
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200


def test_a_kept_alive_connections_next_head_is_due_within_the_timeout(gateway: GatewayProcess) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as s:
        body = _complete()
        s.sendall(
            HALF_HEAD + b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )  # fmt: skip
        # The whole first answer (chunked: it ends with the last chunk), the connection kept alive.
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            data = s.recv(65536)
            assert data, f"closed before the answer ended: {got[-200:]!r}"
            got += data
        assert got.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in got
        s.sendall(HALF_HEAD)  # the next request's head, never finished
        rest = _answer_and_close(s)
    assert rest.startswith(b"HTTP/1.1 408 ")
