"""Connection limits of `gpuyard server`: a header timeout, caps per client address and in total.

uvicorn keeps a connection that never sends a request (or half of one) open forever and accepts
connections until the process runs out of file descriptors; then nobody gets in, ``/health``
included. :class:`ConnectionGuard` sits at two layers of the same server:

- the HTTP protocol (a subclass of uvicorn's, :func:`guarded_protocol`) registers every connection
  when it is accepted and forgets it when it closes. A connection whose request headers are not
  complete ``header_timeout_s`` after it opened, or after its previous response, is answered 408 and
  closed. Past ``max_connections + reserve`` open connections, the oldest idle connection (no request
  in flight) of the address that holds the most is closed to make room; when none is idle the new
  connection is answered 503 and closed at once. The server's descriptors are thus bounded.
- the ASGI application (:meth:`ConnectionGuard.wrap`) sees each request with its connection. A
  connection opened while its address already held ``per_address`` connections, or while the server
  held ``max_connections``, is in the *reserve*: on it only ``/health``, ``/ready`` and requests with
  an admin token are served; others get 429 (the address's cap) or 503 (the total) with
  ``Connection: close``, naming the cap. So a member holding thousands of connections neither
  reaches other members' share nor keeps an operator out.

An address is an IPv4 address or an IPv6 /64 (one host usually has a whole /64). What the guard did
is logged at most once per ``LOG_EVERY_S`` as one line per address, never per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gpuyard.api.limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PER_ADDRESS,
    DEFAULT_RESERVE,
)

log = logging.getLogger("gpuyard.server")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Descriptors kept out of the connection budget: the database, job log files and pipes, the listener.
FD_MARGIN = 512
LOG_EVERY_S = 10.0
# Expired connections closed per turn of the event loop.
SWEEP_BATCH = 128
# Requests served on any connection, even one over a cap: liveness and readiness probes.
ALWAYS_SERVED = ("/health", "/ready")


def raise_nofile_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit; the caps below are fitted to it
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def address_of(peer: tuple[str, int] | None) -> str:
    """The address a connection counts against: the IPv4 address, or the IPv6 /64 (``unix`` for none)."""
    if peer is None:
        return "unix"
    if ":" not in peer[0]:
        return peer[0]  # IPv4, dotted as getpeername gives it
    return _ipv6_group(peer[0])


@functools.lru_cache(maxsize=4096)
def _ipv6_group(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(eq=False)
class _Conn:
    protocol: Any
    peer: tuple[str, int] | None
    address: str
    over: str | None  # None, "address" or "total": the cap it was opened over
    busy: int = 0  # requests in flight


@dataclass
class _Tally:
    """What the guard did since its last log line."""

    reserve: Counter[str] = field(default_factory=Counter)
    refused_requests: Counter[str] = field(default_factory=Counter)
    evicted: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    timed_out: Counter[str] = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return any((self.reserve, self.refused_requests, self.evicted, self.refused, self.timed_out))


class ConnectionGuard:
    """The connection limits of one server (see the module's docstring).

    Args:
        max_connections: connections served as usual; above it, new ones are in the reserve.
        per_address: connections of one address served as usual; above it, new ones are in the reserve.
        reserve: connections allowed past ``max_connections`` (probes and admins get in through them).
        header_timeout_s: a request's headers must be complete this long after the connection opened or
            its previous response ended.
        is_admin: whether a bearer token is an admin's (called in a worker thread; None: nobody is).
    """

    def __init__(
        self,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        per_address: int = DEFAULT_MAX_PER_ADDRESS,
        reserve: int = DEFAULT_RESERVE,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        is_admin: Callable[[str], bool] | None = None,
    ) -> None:
        if max_connections < 1 or per_address < 1 or reserve < 1 or header_timeout_s <= 0:
            raise ValueError("connection limits: caps and the reserve must be >= 1, the timeout > 0")
        self.max_connections, self.per_address, self.reserve = max_connections, per_address, reserve
        self.header_timeout_s = header_timeout_s
        self.is_admin = is_admin
        self.conns: dict[tuple[str, int] | None, _Conn] = {}  # by peer, as in the ASGI scope's client
        self.by_address: dict[str, OrderedDict[int, _Conn]] = {}  # oldest first
        self.tally = _Tally()
        # Connections waiting for a request's headers, by deadline (armed in time order: oldest first).
        self.waiting: OrderedDict[_Conn, float] = OrderedDict()
        self._sweep: asyncio.TimerHandle | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._last_log = 0.0

    @classmethod
    def fitted(
        cls,
        nofile: int,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        per_address: int = DEFAULT_MAX_PER_ADDRESS,
        reserve: int = DEFAULT_RESERVE,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        is_admin: Callable[[str], bool] | None = None,
    ) -> tuple[ConnectionGuard, str | None]:
        """A guard whose caps fit ``nofile`` descriptors, and a note when they had to be lowered."""
        budget = max(nofile - FD_MARGIN, nofile // 2)
        note = None
        if max_connections + reserve > budget:
            reserve = max(1, min(reserve, budget // 16))
            lowered = max(1, budget - reserve)
            note = (
                f"--max-connections {max_connections} lowered to {lowered}: the open-file limit is {nofile} "
                "(raise the hard limit, e.g. LimitNOFILE= in the systemd unit, for more)"
            )
            max_connections = lowered
        per_address = min(per_address, max_connections)
        guard = cls(max_connections, per_address, reserve, header_timeout_s, is_admin)
        return guard, note

    def describe(self) -> str:
        """One phrase for the server's startup line."""
        return (
            f"connections: at most {self.max_connections} (+{self.reserve} for /health and admins), "
            f"{self.per_address} per address, request headers within {self.header_timeout_s:g} s"
        )

    # -- the protocol side -------------------------------------------------------------------------

    def opened(self, protocol: Any) -> None:
        """A connection was accepted (``protocol.client``: its peer; ``protocol.transport``)."""
        peer = protocol.client
        address = address_of(peer)
        mine = self.by_address.get(address)
        total = len(self.conns)
        over = (
            "address"
            if mine is not None and len(mine) >= self.per_address
            else "total"
            if total >= self.max_connections
            else None
        )
        if total >= self.max_connections + self.reserve and not self._evict():
            self.tally.refused[address] += 1
            self._note()
            _close(protocol.transport, 503, self._full_detail())
            return
        conn = _Conn(protocol, peer, address, over)
        old = self.conns.get(peer)
        if old is not None:  # a peer seen again before its close was noticed: forget the old one
            self._forget(old)
        self.conns[peer] = conn
        self.by_address.setdefault(address, OrderedDict())[id(conn)] = conn
        if over is not None:
            self.tally.reserve[address] += 1
            self._note()
        self._arm(conn)

    def closed(self, protocol: Any) -> None:
        """A connection closed (either side)."""
        conn = self.conns.get(protocol.client)
        if conn is not None and conn.protocol is protocol:
            self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)
        if self.conns.get(conn.peer) is conn:
            del self.conns[conn.peer]
        mine = self.by_address.get(conn.address)
        if mine is not None:
            mine.pop(id(conn), None)
            if not mine:
                del self.by_address[conn.address]

    def _arm(self, conn: _Conn) -> None:
        """Start the connection's header clock (one sweep timer serves every connection)."""
        self.waiting.pop(conn, None)
        self.waiting[conn] = time.monotonic() + self.header_timeout_s
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._sweep_every(), self._timed_out)

    def _disarm(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)

    def _sweep_every(self) -> float:
        return min(max(self.header_timeout_s / 4, 0.05), 1.0)

    def _timed_out(self) -> None:
        """Answer 408 and close every connection whose headers are overdue."""
        self._sweep = None
        now = time.monotonic()
        detail = (
            f"request headers not received within {self.header_timeout_s:g} s "
            "(gpuyard server --header-timeout)"
        )
        closed = 0
        while self.waiting and closed < SWEEP_BATCH:
            conn, deadline = next(iter(self.waiting.items()))
            if deadline > now:
                break
            self._forget(conn)
            self.tally.timed_out[conn.address] += 1
            _close(conn.protocol.transport, 408, detail)
            closed += 1
        if self.tally.timed_out:
            self._note()
        if self.waiting:
            # A full batch: the rest at once, after the requests waiting meanwhile (a flood's thousands
            # of expiries never hold the loop for long).
            wait = 0.0 if closed >= SWEEP_BATCH else self._sweep_every()
            self._sweep = asyncio.get_running_loop().call_later(wait, self._timed_out)

    def _evict(self) -> bool:
        """Close the oldest idle connection of the address holding the most; False when none is idle."""
        for address in sorted(self.by_address, key=lambda a: -len(self.by_address[a])):
            for conn in self.by_address[address].values():
                if not conn.busy:
                    self._forget(conn)
                    self.tally.evicted[address] += 1
                    self._note()
                    conn.protocol.transport.abort()  # idle: nothing of its to flush
                    return True
        return False

    def _full_detail(self) -> str:
        return (
            f"server busy: {len(self.conns)} connections open, every one with a request in flight "
            f"(gpuyard server --max-connections {self.max_connections})"
        )

    # -- the application side ----------------------------------------------------------------------

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` with each HTTP request checked against its connection's reserve status."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            conn = self.conns.get(scope.get("client")) if scope["type"] == "http" else None
            if conn is None:
                await app(scope, receive, send)
                return
            conn.busy += 1
            self._disarm(conn)
            try:
                refusal = await self._refusal(conn, scope)
                if refusal is not None:
                    await _answer(send, *refusal)
                    return
                await app(scope, receive, send)
            finally:
                conn.busy -= 1
                if not conn.busy and self.conns.get(conn.peer) is conn:
                    self._arm(conn)  # the next request's headers are due within the timeout

        return guarded

    async def _refusal(self, conn: _Conn, scope: Scope) -> tuple[int, str] | None:
        """None to serve the request; else the status and detail to answer it with."""
        if conn.over is None:
            return None
        mine = len(self.by_address.get(conn.address, ()))
        if conn.over == "address" and mine <= self.per_address and len(self.conns) <= self.max_connections:
            conn.over = None  # the pressure is gone: an ordinary connection from now on
            return None
        if conn.over == "total" and len(self.conns) <= self.max_connections:
            conn.over = None
            return None
        if scope.get("path", "").rstrip("/") in ALWAYS_SERVED or await self._admin(scope):
            return None
        self.tally.refused_requests[conn.address] += 1
        self._note()
        if conn.over == "address":
            return 429, (
                f"too many connections from {conn.address}: {mine} open, at most {self.per_address} "
                "per address (gpuyard server --max-connections-per-address); close idle ones and retry"
            )
        return 503, (
            f"server at its connection cap: {len(self.conns)} open, at most {self.max_connections} "
            "(gpuyard server --max-connections); retry shortly"
        )

    async def _admin(self, scope: Scope) -> bool:
        if self.is_admin is None:
            return False
        token = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
        if not token:
            return False
        from anyio import to_thread

        check = self.is_admin
        try:
            return bool(await to_thread.run_sync(lambda: check(token)))
        except Exception:  # an unknown or revoked token, a store error: not an admin
            return False

    # -- the log -----------------------------------------------------------------------------------

    def _note(self) -> None:
        """Schedule the next log line: at once after a quiet spell, else LOG_EVERY_S after the last."""
        if self._flush is not None:
            return
        wait = max(0.0, self._last_log + LOG_EVERY_S - time.monotonic())
        self._flush = asyncio.get_running_loop().call_later(wait, self.flush_log)

    def flush_log(self) -> None:
        """Log what the guard did since the last line: one line per address."""
        self._flush = None
        tally, self.tally = self.tally, _Tally()
        if not tally:
            return
        self._last_log = time.monotonic()
        addresses = (
            set(tally.reserve)
            | set(tally.refused_requests)
            | set(tally.evicted)
            | set(tally.refused)
            | set(tally.timed_out)
        )
        for address in sorted(addresses):
            parts = [
                f"{n} {what}"
                for n, what in (
                    (tally.reserve[address], "opened over a cap"),
                    (tally.refused_requests[address], "requests refused (429/503)"),
                    (tally.evicted[address], "idle connections closed to make room"),
                    (tally.timed_out[address], "closed without complete headers (408)"),
                    (tally.refused[address], "refused (503, all busy)"),
                )
                if n
            ]
            log.warning(
                "connections from %s: %s; %d open now (caps: %d per address, %d in total)",
                address,
                ", ".join(parts),
                len(self.by_address.get(address, ())),
                self.per_address,
                self.max_connections,
            )


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol ``base`` that registers its connections with ``guard``."""

    class GuardedProtocol(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            guard.opened(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

    return GuardedProtocol


def _response(status: int, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    reason = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _close(transport: Any, status: int, detail: str) -> None:
    """Answer a connection that has no request in flight, then close it."""
    with contextlib.suppress(Exception):  # the peer is gone already
        transport.write(_response(status, detail))
    transport.close()


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
