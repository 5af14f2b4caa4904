"""The connection guard's shares: a connection is its address's until a token charges it to a team, and
a team's request is judged by its own team's connections and requests, never by the shared address.

The guard is driven directly (fake transports, a fake ASGI app) on one event loop: no sockets.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpuyard.connections import ADMINS, ConnectionGuard, team_holder

pytestmark = pytest.mark.unit

TOKENS = {"tok-a": team_holder("a"), "tok-b": team_holder("b"), "tok-admin": ADMINS}


class _Transport:
    def __init__(self) -> None:
        self.closed = False
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class _Protocol:
    port = 1000

    def __init__(self, host: str = "127.0.0.1") -> None:
        _Protocol.port += 1
        self.client = (host, _Protocol.port)
        self.transport = _Transport()


def _identify(token: str) -> str:
    if token not in TOKENS:
        raise PermissionError("invalid API token")
    return TOKENS[token]


def _guard(**kw: Any) -> ConnectionGuard:
    options: dict[str, Any] = {
        "max_connections": 40,
        "per_address": 10,
        "reserve": 4,
        "header_timeout_s": 60,
        "identify": _identify,
        "per_team": 5,
        "per_team_requests": 2,
    }
    return ConnectionGuard(**{**options, **kw})


async def _request(
    guard: ConnectionGuard, proto: _Protocol, token: str | None, path: str = "/jobs", hold: Any = None
) -> tuple[int, str]:
    """One request on ``proto``'s connection through the guard: the status and detail answered."""
    answer: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if hold is not None:
            await hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] = message["body"]

    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    scope = {"type": "http", "client": proto.client, "path": path, "headers": headers}
    await guard.wrap(app)(scope, None, send)  # type: ignore[arg-type]
    detail = json.loads(answer["body"]).get("detail", "") if answer["body"] != b"{}" else ""
    return answer["status"], detail


def _open(guard: ConnectionGuard, n: int, host: str = "127.0.0.1") -> list[_Protocol]:
    protos = [_Protocol(host) for _ in range(n)]
    for p in protos:
        guard.opened(p)
    return protos


def test_a_team_is_served_on_an_address_another_team_fills() -> None:
    async def main() -> None:
        guard = _guard()
        _open(guard, 30)  # team a's job: 30 idle connections from loopback, no token sent
        b = _open(guard, 1)[0]
        # Without a token, b's connection is over the address's share: 429 naming it.
        status, detail = await _request(guard, b, None)
        assert status == 429 and "too many connections from 127.0.0.1" in detail, detail
        # With team b's token it is charged to team b, which holds one connection: served.
        assert await _request(guard, b, "tok-b") == (200, "")
        assert len(guard.by_holder[team_holder("b")]) == 1
        # Even past the total cap (40 unclaimed), a team under its share gets in.
        _open(guard, 12)
        late = _open(guard, 1)[0]
        assert len(guard.conns) > guard.max_connections
        assert await _request(guard, late, "tok-b") == (200, "")
        status, detail = await _request(guard, _open(guard, 1)[0], None)
        assert status in (429, 503), detail

    asyncio.run(main())


def test_a_team_over_its_share_is_refused_and_others_are_not() -> None:
    async def main() -> None:
        guard = _guard()
        mine = _open(guard, 8)
        answers = [await _request(guard, p, "tok-a") for p in mine]
        assert [s for s, _ in answers] == [200] * 5 + [429] * 3, answers
        assert "too many connections of team a: 6 open, at most 5 per team" in answers[5][1]
        assert "--max-connections-per-team" in answers[5][1]
        # Another team and an admin on the same address are served.
        assert (await _request(guard, _open(guard, 1)[0], "tok-b"))[0] == 200
        assert (await _request(guard, _open(guard, 1)[0], "tok-admin"))[0] == 200
        # Probes are always served.
        assert (await _request(guard, mine[-1], "tok-a", path="/health"))[0] == 200
        # Team a closes three connections: its latecomers are served again.
        for p in mine[:3]:
            guard.closed(p)
        assert (await _request(guard, mine[-1], "tok-a"))[0] == 200

    asyncio.run(main())


def test_requests_in_flight_are_bounded_per_team() -> None:
    async def main() -> None:
        guard = _guard()
        hold = asyncio.Event()
        a = _open(guard, 3)
        slow = [asyncio.create_task(_request(guard, p, "tok-a", hold=hold)) for p in a[:2]]
        while sum(guard.in_flight.values()) < 2:
            await asyncio.sleep(0)
        status, detail = await _request(guard, a[2], "tok-a")
        assert status == 429 and "too many requests of team a in flight: 2, at most 2" in detail, detail
        # Team b is not held up by team a's requests.
        assert (await _request(guard, _open(guard, 1)[0], "tok-b"))[0] == 200
        hold.set()
        assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
        assert not guard.in_flight
        assert (await _request(guard, a[2], "tok-a"))[0] == 200

    asyncio.run(main())


def test_an_invalid_token_stays_its_address_and_identities_are_cached() -> None:
    calls: list[str] = []

    def counting(token: str) -> str:
        calls.append(token)
        return _identify(token)

    async def main() -> None:
        guard = _guard(identify=counting)
        _open(guard, 10)
        p = _open(guard, 1)[0]
        status, _ = await _request(guard, p, "forged")
        assert status == 429 and p.client in guard.conns
        assert guard.conns[p.client].holder == "127.0.0.1"
        q = _open(guard, 1)[0]
        for _ in range(5):
            assert (await _request(guard, q, "tok-b"))[0] == 200
        assert calls.count("tok-b") == 1 and calls.count("forged") == 1

    asyncio.run(main())


def test_eviction_takes_the_largest_holders_oldest_idle_connection() -> None:
    async def main() -> None:
        guard = _guard(max_connections=20, reserve=2, per_address=10)
        flood = _open(guard, 20)
        b = _open(guard, 2)
        for p in b:
            assert (await _request(guard, p, "tok-b"))[0] == 200
        assert len(guard.conns) == 22
        newcomer = _open(guard, 1)[0]
        assert flood[0].transport.closed and newcomer.client in guard.conns
        assert not any(p.transport.closed for p in b)

    asyncio.run(main())


def test_fitted_keeps_each_share_under_half_of_the_total() -> None:
    guard, note = ConnectionGuard.fitted(1 << 20, max_connections=100, per_address=80, per_team=90)
    assert (guard.per_address, guard.per_team) == (50, 50)
    assert note is not None and "--max-connections-per-team 90 lowered to 50" in note


def test_a_head_received_in_time_is_not_timed_out_before_its_task_runs() -> None:
    """The header clock stops when uvicorn's protocol has the whole head (it makes the request's cycle),
    not when the request's task first runs: on a loaded event loop the sweep can come between the two,
    and must not answer 408 to a request that came in time. A head still partial is answered 408."""
    from gpuyard.connections import guarded_protocol

    class _Uvicorn(asyncio.Protocol):  # what the guard relies on: a new ``cycle`` once a head is whole
        def __init__(self) -> None:
            self.client: tuple[str, int] | None = None
            self.transport: Any = None
            self.cycle: object | None = None
            self.buffer = b""

        def connection_made(self, transport: Any) -> None:
            _Protocol.port += 1
            self.client, self.transport = ("127.0.0.1", _Protocol.port), transport

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            if b"\r\n\r\n" in self.buffer:
                self.cycle, self.buffer = object(), b""

    async def main() -> None:
        guard = _guard(header_timeout_s=0.05)
        protocol = guarded_protocol(_Uvicorn, guard)
        whole, partial = protocol(), protocol()
        for p in (whole, partial):
            p.connection_made(_Transport())
        whole.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n")
        partial.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        deadline = max(guard.waiting.values(), default=0.0)
        while asyncio.get_running_loop().time() <= deadline + 0.01 or guard.waiting:
            await asyncio.sleep(0.01)  # the sweep runs; the whole head's task never has
        assert partial.transport.closed and b"408" in partial.transport.written
        assert not whole.transport.closed and whole.client in guard.conns

    asyncio.run(main())
