"""The vLLM gateway's relay against a replica that is a real HTTP/1.1 server on 127.0.0.1 written
here (it answers like vLLM: server-sent events in chunked framing, JSON with a Content-Length), so that
its failures can be chosen: keep-alive on both sides with every request checked again, a client that
hangs up (its slot freed, the replica's request aborted), a replica that dies mid-stream (one error
event), a client that never reads (cut, others served), malformed answers, hostile clients."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.serve.fake_replica import AUTH, KEY, FakeReplica
from tests.integration.serve.fake_replica import event as _event
from tests.waiting import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class Gatewayed:
    """The gateway app (with its key gate and watcher) served by uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, replica: FakeReplica) -> None:
        import uvicorn

        from gpuyard.serve.access import Access, KeyGate, key_hash, openai_body
        from gpuyard.serve.llm.gateway import Gateway, GatewayLimits, build_gateway_app
        from gpuyard.serve.llm.vllm_engine import Replica, VllmConfig

        rep = Replica(0, replica.port, key=replica.key)
        rep.ready = True
        cfg = VllmConfig(folder=Path("/nonexistent"), name="m", context=256)
        self.gw = Gateway(cfg, [rep], GatewayLimits(max_body_bytes=4096, vocab=1000))
        self.gw.write_stall_s = 1.0
        self.gw.body_timeout_s = 2.0
        app = KeyGate(build_gateway_app(self.gw), Access(key_hash(KEY), None, False), openai_body)
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="on", log_config=None
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    def outstanding(self) -> int:
        return self.gw.replicas[0].outstanding

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def served() -> Iterator[tuple[Gatewayed, FakeReplica]]:
    replica = FakeReplica()
    g = Gatewayed(replica)
    yield g, replica
    g.stop()


def _body(prompt: str, stream: bool = True) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream}


def test_streamed_and_whole_answers_over_kept_alive_connections_each_request_checked(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, replica = served
    with httpx.Client(base_url=g.url, timeout=30) as client:  # one connection to the gateway
        for _ in range(3):
            r = client.post("/v1/completions", json=_body("stream"), headers=AUTH)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.content == _event(0) + _event(1) + _event(2) + b"data: [DONE]\n\n"
            # The next request on the same connection is checked again: no key, 401.
            r = client.post("/v1/completions", json=_body("stream"))
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = client.post("/v1/completions", json=_body("json", stream=False), headers=AUTH)
        assert r.status_code == 200 and r.json() == {"choices": [{"text": "whole"}]}
        r = client.post("/v1/completions", json=_body("refuse", stream=False), headers=AUTH)
        assert r.status_code == 400 and r.json() == {"error": "no"}
        r = client.post("/v1/completions", json=_body("x" * 5000), headers=AUTH)
        assert r.status_code == 413
    # The replica got its own key, never the caller's, and the gateway kept its connection alive.
    assert set(replica.keys) == {f"Bearer {replica.key}"} and len(replica.keys) == 5
    assert replica.connections == 1
    assert g.outstanding() == 0


def test_a_client_that_hangs_up_frees_its_slot_and_the_replicas_request(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, replica = served
    with (
        httpx.Client(base_url=g.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=_body("hold"), headers=AUTH) as s,
    ):
        # Hold the iterator: a dropped one closes httpx's stream (GeneratorExit), a hang-up too early.
        raw = s.iter_raw()
        first = next(raw)
        assert first.startswith(b"data: ")
        assert g.outstanding() == 1 and replica.open == 1
    wait_for(lambda: g.outstanding() == 0 and replica.open == 0, timeout=30)
    assert b'gpuyard_gateway_requests_total{outcome="cancelled"} 1.0' in _metrics(g)


def test_a_replica_that_dies_mid_stream_gives_one_error_event_then_503(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, _ = served
    r = httpx.post(f"{g.url}/v1/completions", json=_body("die"), headers=AUTH, timeout=30)
    assert r.status_code == 200
    events = [ln for ln in r.text.split("\n\n") if ln]
    assert events[0] == _event(0).decode().strip()
    err = json.loads(events[1][len("data: ") :])["error"]
    assert err["code"] == 503 and "did not answer" in err["message"] and len(events) == 2
    r = httpx.post(f"{g.url}/v1/completions", json=_body("badhead"), headers=AUTH, timeout=30)
    assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]
    assert g.outstanding() == 0


def test_a_client_that_never_reads_is_cut_and_others_are_served(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, replica = served
    body = json.dumps(_body("flood")).encode()
    stuck = socket.create_connection(("127.0.0.1", g.port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        wait_for(lambda: g.outstanding() == 1, timeout=30)
        # While it sits there, another client is answered.
        r = httpx.post(f"{g.url}/v1/completions", json=_body("stream"), headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        # The watchdog cuts it (write_stall_s = 1 here): its slot and the replica's request are freed.
        wait_for(lambda: g.outstanding() == 0, timeout=60)
        wait_for(lambda: replica.open <= 1, timeout=30)  # the flood's connection closed
        assert b'gpuyard_gateway_requests_total{outcome="client_stalled"} 1.0' in _metrics(g)
    finally:
        stuck.close()


def test_hostile_clients_are_refused_or_bounded_without_wedging_others(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, _ = served

    def raw(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", g.port), timeout=30) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            return b"".join(iter(lambda: s.recv(65536), b""))

    assert raw(b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400")
    huge = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2_000_000 + b"\r\n\r\n"
    answer = raw(huge)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 4")  # refused or closed, never served
    # A slow client holding a half-sent request head does not hold up anyone else.
    slow = socket.create_connection(("127.0.0.1", g.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    try:
        r = httpx.post(f"{g.url}/v1/completions", json=_body("stream"), headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    finally:
        slow.close()
    # A declared body over the limit is refused before it is sent.
    declared = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                   + b"\r\nContent-Length: 999999999\r\n\r\n{}")  # fmt: skip
    assert declared.startswith(b"HTTP/1.1 413")
    assert g.outstanding() == 0


def _metrics(g: Gatewayed) -> bytes:
    return httpx.get(f"{g.url}/metrics", headers=AUTH, timeout=30).content


def test_a_pooled_connection_too_old_to_reuse_is_closed(served: tuple[Gatewayed, FakeReplica]) -> None:
    g, replica = served
    r = httpx.post(f"{g.url}/v1/completions", json=_body("stream"), headers=AUTH, timeout=30)
    assert r.status_code == 200
    assert replica.open == 1 and len(g.gw._pools[0].idle) == 1
    # Past the reuse window (3 s) the watcher closes it: the replica sees its connection end, and the
    # gateway holds no descriptor for it.
    wait_for(lambda: replica.open == 0, timeout=60)
    assert not g.gw._pools[0].idle
    assert b'gpuyard_gateway_pooled_connections{replica="0"} 0.0' in _metrics(g)


def test_a_body_sent_too_slowly_is_answered_408_and_its_connection_closed(
    served: tuple[Gatewayed, FakeReplica],
) -> None:
    g, replica = served
    with socket.create_connection(("127.0.0.1", g.port), timeout=120) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        got = b"".join(iter(lambda: s.recv(65536), b""))  # until the gateway closes it
    assert got.startswith(b"HTTP/1.1 408 ") and b"request body not received within 2 s" in got
    assert g.outstanding() == 0 and replica.connections == 0
