"""Connection limits of `gpuyard server`: a header timeout, and shares of the server per team, per
client address and in total.

uvicorn keeps a connection that never sends a request (or half of one) open forever and accepts
connections until the process runs out of file descriptors; then nobody gets in, ``/health``
included. And a job on the server's machine shares the server's address (127.0.0.1) with every other
team's jobs and clients, so caps counted by address alone let one team's job refuse the others.
:class:`ConnectionGuard` sits at two layers of the same server:

- the HTTP protocol (a subclass of uvicorn's, :func:`guarded_protocol`) registers every connection
  when it is accepted and forgets it when it closes. A connection whose request headers are not
  complete ``header_timeout_s`` after it opened, or after its previous response, is answered 408 and
  closed. Past ``max_connections + reserve`` open connections, the oldest idle connection (no request
  in flight) of the *holder* with the most connections is closed to make room; when none is idle the
  new connection is answered 503 and closed at once. The server's descriptors are thus bounded.
- the ASGI application (:meth:`ConnectionGuard.wrap`) sees each request with its connection and its
  token, and charges the connection to a holder:

  * a connection is charged to its **address** (an IPv4 address, an IPv6 /64) from its accept until a
    request on it carries a valid token;
  * from then on it is charged to the token's **team** (a member's, a viewer's or a job's token: the
    team of its user), or to the admins (never refused);
  * a connection that joined its holder while the holder already had its share (``per_address``
    connections of an address, ``per_team`` of a team) is served only ``/health`` and ``/ready``
    until the holder is back under its share: 429 naming the cap, with ``Connection: close``. An
    address's connection opened while the server held ``max_connections`` is likewise refused
    (503) until a token charges it to a team: the total cap is for connections nobody has claimed;
  * at most ``per_team_requests`` requests of one holder are in flight at once (worker threads,
    database sessions); the next is answered 429 at once.

  So a team's request is judged by its own team's connections and requests, never by the address it
  shares with others: however many connections one job holds, idle or not, another team's request
  gets in (its new connection evicts the oldest idle one of the largest holder) and is served. Each
  share is at most half of ``max_connections`` (lowered to it at start, said in the log).

What the guard did is logged at most once per ``LOG_EVERY_S`` as one line per holder, never per
connection.

The model servers gpuyard starts (the vLLM gateway and the language-model server of ``gpuyard serve``
and ``gpuyard deploy``) are served through the same guard (:func:`model_server_guard`,
:func:`guarded_uvicorn`): the header timeout and the total and per-address caps, no teams (their key
gate says who may call) and no cap on requests in flight beyond the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gpuyard.limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PER_ADDRESS,
    DEFAULT_MAX_PER_TEAM,
    DEFAULT_MAX_REQUESTS_PER_TEAM,
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
# The holder of admins' connections (never refused); teams are "team NAME", addresses their address.
ADMINS = "admins"
TEAM_PREFIX = "team "
# How long a token's holder is remembered (the app authenticates every request itself, at once).
IDENTITY_TTL_S = 5.0
IDENTITY_CACHE = 4096


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
    holder: str  # its address until a token charges it to a team (or to the admins)
    over: str | None  # None, "share" (its holder's) or "total": the cap it joined over
    busy: int = 0  # requests in flight


def team_holder(team: str) -> str:
    """The holder name of a team's connections (never an address: addresses hold no space)."""
    return TEAM_PREFIX + team


def _shown(holder: str) -> str:
    return f"of team {holder[len(TEAM_PREFIX) :]}" if holder.startswith(TEAM_PREFIX) else f"from {holder}"


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
        per_address: connections of one address served before a token charges them to a team.
        reserve: connections allowed past ``max_connections`` (probes, admins and teams under their
            share get in through them).
        header_timeout_s: a request's headers must be complete this long after the connection opened or
            its previous response ended.
        identify: a bearer token's holder: :data:`ADMINS` or :func:`team_holder` of its team; raises for
            an invalid token (called in a worker thread; None: every request is its address's).
        per_team: connections charged to one team served as usual.
        per_team_requests: requests of one holder (team or address) in flight at once.
    """

    def __init__(
        self,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        per_address: int = DEFAULT_MAX_PER_ADDRESS,
        reserve: int = DEFAULT_RESERVE,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        identify: Callable[[str], str] | None = None,
        per_team: int = DEFAULT_MAX_PER_TEAM,
        per_team_requests: int = DEFAULT_MAX_REQUESTS_PER_TEAM,
        command: str | None = "gpuyard server",
    ) -> None:
        if (
            min(max_connections, per_address, reserve, per_team, per_team_requests) < 1
            or header_timeout_s <= 0
        ):
            raise ValueError("connection limits: caps and the reserve must be >= 1, the timeout > 0")
        self.max_connections, self.per_address, self.reserve = max_connections, per_address, reserve
        self.per_team, self.per_team_requests = per_team, per_team_requests
        self.header_timeout_s = header_timeout_s
        self.identify = identify
        # The command whose options set the caps, named in refusals (None: they are not options).
        self.command = command
        self.conns: dict[tuple[str, int] | None, _Conn] = {}  # by peer, as in the ASGI scope's client
        self.by_holder: dict[str, OrderedDict[int, _Conn]] = {}  # oldest first
        self.in_flight: Counter[str] = Counter()  # requests being served, by holder
        # sha256(token) -> (holder or None for an invalid token, until when): LRU, IDENTITY_CACHE at most
        self._identities: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
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
        identify: Callable[[str], str] | None = None,
        per_team: int = DEFAULT_MAX_PER_TEAM,
        per_team_requests: int = DEFAULT_MAX_REQUESTS_PER_TEAM,
        command: str | None = "gpuyard server",
    ) -> tuple[ConnectionGuard, str | None]:
        """A guard whose caps fit ``nofile`` descriptors, and a note when they had to be lowered.

        No one holder's share may pass half of ``max_connections``: what one team or address holds
        leaves the other half to the rest.
        """
        budget = max(nofile - FD_MARGIN, nofile // 2)
        notes = []

        def named(option: str, cap: str) -> str:  # the option that sets a cap, else the cap's name
            return option if command else cap

        total = named("--max-connections", "the connection cap")
        if max_connections + reserve > budget:
            reserve = max(1, min(reserve, budget // 16))
            lowered = max(1, budget - reserve)
            notes.append(
                f"{total} {max_connections} lowered to {lowered}: the open-file limit is {nofile} "
                "(raise the hard limit, e.g. LimitNOFILE= in the systemd unit, for more)"
            )
            max_connections = lowered
        half = max(1, max_connections // 2)
        for option, value in (("per-address", per_address), ("per-team", per_team)):
            if value > half and (command is not None or option == "per-address"):
                notes.append(
                    f"{named('--max-connections-' + option, 'the cap ' + option.replace('-', ' '))} {value} "
                    f"lowered to {half}: one holder's share is at most half of {total} ({max_connections})"
                )
        per_address, per_team = min(per_address, half), min(per_team, half)
        guard = cls(
            max_connections,
            per_address,
            reserve,
            header_timeout_s,
            identify,
            per_team,
            per_team_requests,
            command,
        )
        return guard, "; ".join(notes) or None

    def _via(self, option: str, otherwise: str = "") -> str:
        """`` (COMMAND OPTION)`` naming what sets a cap, or `` (OTHERWISE)`` where no option does."""
        if self.command is not None:
            return f" ({self.command} {option})"
        return f" ({otherwise})" if otherwise else ""

    def describe(self) -> str:
        """One phrase for the server's startup line."""
        if self.identify is None:
            return (
                f"connections: {self.per_address} per client address, at most {self.max_connections} "
                f"(+{self.reserve}), request headers within {self.header_timeout_s:g} s"
            )
        return (
            f"connections: {self.per_team} per team and {self.per_team_requests} of its requests in flight, "
            f"{self.per_address} per address until a token names the team, at most "
            f"{self.max_connections} unclaimed (+{self.reserve}), request headers within "
            f"{self.header_timeout_s:g} s"
        )

    # -- the protocol side -------------------------------------------------------------------------

    def opened(self, protocol: Any) -> None:
        """A connection was accepted (``protocol.client``: its peer; ``protocol.transport``)."""
        peer = protocol.client
        address = address_of(peer)
        total = len(self.conns)
        if total >= self.max_connections + self.reserve and not self._evict():
            self.tally.refused[address] += 1
            self._note()
            _close(protocol.transport, 503, self._full_detail())
            return
        conn = _Conn(protocol, peer, address, address, None)
        old = self.conns.get(peer)
        if old is not None:  # a peer seen again before its close was noticed: forget the old one
            self._forget(old)
        self.conns[peer] = conn
        self._join(conn, address)
        self._arm(conn)

    def _join(self, conn: _Conn, holder: str) -> None:
        """Charge ``conn`` to ``holder``: over its share if the holder had its share already."""
        mine = self.by_holder.setdefault(holder, OrderedDict())
        cap = self._share(holder)
        if cap is not None and len(mine) >= cap:
            conn.over = "share"
        elif holder == conn.address and len(self.conns) > self.max_connections:
            conn.over = "total"  # unclaimed connections past the total: only a token gets them served
        else:
            conn.over = None
        conn.holder = holder
        mine[id(conn)] = conn
        if conn.over is not None:
            self.tally.reserve[holder] += 1
            self._note()

    def _move(self, conn: _Conn, holder: str) -> None:
        """Charge ``conn`` to ``holder`` instead of its present one (its token named another)."""
        self._leave(conn)
        self._join(conn, holder)

    def _leave(self, conn: _Conn) -> None:
        mine = self.by_holder.get(conn.holder)
        if mine is not None:
            mine.pop(id(conn), None)
            if not mine:
                del self.by_holder[conn.holder]

    def _share(self, holder: str) -> int | None:
        """Connections served as usual for ``holder`` (None: no cap, the admins)."""
        if holder == ADMINS:
            return None
        return self.per_team if holder.startswith(TEAM_PREFIX) else self.per_address

    def closed(self, protocol: Any) -> None:
        """A connection closed (either side)."""
        conn = self.conns.get(protocol.client)
        if conn is not None and conn.protocol is protocol:
            self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)
        if self.conns.get(conn.peer) is conn:
            del self.conns[conn.peer]
        self._leave(conn)

    def _arm(self, conn: _Conn) -> None:
        """Start the connection's header clock (one sweep timer serves every connection)."""
        self.waiting.pop(conn, None)
        self.waiting[conn] = time.monotonic() + self.header_timeout_s
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._sweep_every(), self._timed_out)

    def _disarm(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)

    def head_received(self, protocol: Any) -> None:
        """A request's head on ``protocol``'s connection is complete: its header clock stops now, not
        when the request's task first runs (on a loaded event loop that can be seconds later, and the
        sweep would then answer 408 to a request whose head came in time)."""
        conn = self.conns.get(protocol.client)
        if conn is not None and conn.protocol is protocol:
            self._disarm(conn)

    def _sweep_every(self) -> float:
        return min(max(self.header_timeout_s / 4, 0.05), 1.0)

    def _timed_out(self) -> None:
        """Answer 408 and close every connection whose headers are overdue."""
        self._sweep = None
        now = time.monotonic()
        detail = (
            f"request headers not received within {self.header_timeout_s:g} s{self._via('--header-timeout')}"
        )
        closed = 0
        while self.waiting and closed < SWEEP_BATCH:
            conn, deadline = next(iter(self.waiting.items()))
            if deadline > now:
                break
            self._forget(conn)
            self.tally.timed_out[conn.holder] += 1
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
        """Close the oldest idle connection of the holder with the most; False when none is idle."""
        for holder in sorted(self.by_holder, key=lambda h: -len(self.by_holder[h])):
            for conn in self.by_holder[holder].values():
                if not conn.busy:
                    self._forget(conn)
                    self.tally.evicted[holder] += 1
                    self._note()
                    conn.protocol.transport.abort()  # idle: nothing of its to flush
                    return True
        return False

    def _full_detail(self) -> str:
        return (
            f"server busy: {len(self.conns)} connections open, every one with a request in flight"
            + self._via(f"--max-connections {self.max_connections}", f"at most {self.max_connections}")
        )

    # -- the application side ----------------------------------------------------------------------

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` with each HTTP request charged to its connection's holder and checked against its
        shares (see the module's docstring)."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            conn = self.conns.get(scope.get("client")) if scope["type"] == "http" else None
            if conn is None:
                await app(scope, receive, send)
                return
            conn.busy += 1
            self._disarm(conn)
            charged: str | None = None
            try:
                refusal, charged = await self._admit(conn, scope)
                if refusal is not None:
                    await _answer(send, *refusal)
                    return
                await app(scope, receive, send)
            finally:
                if charged is not None:
                    self.in_flight[charged] -= 1
                    if self.in_flight[charged] <= 0:
                        del self.in_flight[charged]
                conn.busy -= 1
                if not conn.busy and self.conns.get(conn.peer) is conn:
                    self._arm(conn)  # the next request's headers are due within the timeout

        return guarded

    async def _admit(self, conn: _Conn, scope: Scope) -> tuple[tuple[int, str] | None, str | None]:
        """Charge the request's connection to its token's holder; return the refusal (None to serve:
        status and detail else) and the holder whose in-flight count it took (None: not counted)."""
        if scope.get("path", "").rstrip("/") in ALWAYS_SERVED:
            return None, None  # probes: always, uncounted (an async route: no worker thread)
        holder = await self._holder(scope)
        if self.conns.get(conn.peer) is not conn:
            return (503, "connection closed while its token was checked"), None
        if holder is not None and holder != conn.holder:
            self._move(conn, holder)
        holder = conn.holder
        if holder == ADMINS:
            return None, None
        if conn.over == "share" and len(self.by_holder.get(holder, ())) <= (self._share(holder) or 0):
            conn.over = None  # the pressure is gone: an ordinary connection from now on
        if conn.over == "total" and len(self.conns) <= self.max_connections:
            conn.over = None
        if conn.over is not None:
            self.tally.refused_requests[holder] += 1
            self._note()
            return self._over_detail(conn), None
        if self.in_flight[holder] >= self.per_team_requests:
            self.tally.refused_requests[holder] += 1
            self._note()
            who = f"team {holder[len(TEAM_PREFIX) :]}" if holder.startswith(TEAM_PREFIX) else holder
            return (
                429,
                f"too many requests of {who} in flight: {self.in_flight[holder]}, at most "
                f"{self.per_team_requests}{self._via('--max-requests-per-team')}; retry when they end",
            ), None
        self.in_flight[holder] += 1
        return None, holder

    def _over_detail(self, conn: _Conn) -> tuple[int, str]:
        mine = len(self.by_holder.get(conn.holder, ()))
        tokens = self.identify is not None  # a token can charge the connection to a team
        if conn.over == "total" and self.identify is None:
            return 503, (
                f"server at its connection cap: {len(self.conns)} open, at most {self.max_connections}"
                f"{self._via('--max-connections')}; retry shortly"
            )
        if conn.over == "total":
            return 503, (
                f"server at its connection cap: {len(self.conns)} open, at most {self.max_connections} "
                f"without a token{self._via('--max-connections')}; retry shortly, with a token"
            )
        if conn.holder.startswith(TEAM_PREFIX):
            return 429, (
                f"too many connections of team {conn.holder[len(TEAM_PREFIX) :]}: {mine} open, at most "
                f"{self.per_team} per team{self._via('--max-connections-per-team')}; close idle ones "
                "and retry"
            )
        return 429, (
            f"too many connections from {conn.address}: {mine} open{' without a token' if tokens else ''}, "
            f"at most {self.per_address} per address{self._via('--max-connections-per-address')}; close "
            "idle ones and retry"
            + (", or send a token: a team's requests count against its own share" if tokens else "")
        )

    async def _holder(self, scope: Scope) -> str | None:
        """The holder the request's bearer token names (None: no token, or an invalid one)."""
        if self.identify is None:
            return None
        token = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
        if not token:
            return None
        key = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        now = time.monotonic()
        known = self._identities.get(key)
        if known is not None and known[1] > now:
            self._identities.move_to_end(key)
            return known[0]
        from anyio import to_thread

        check = self.identify
        try:
            holder: str | None = str(await to_thread.run_sync(lambda: check(token)))
        except Exception:  # an unknown, revoked or expired token, a store error: its address's
            holder = None
        self._identities[key] = (holder, time.monotonic() + IDENTITY_TTL_S)
        self._identities.move_to_end(key)
        while len(self._identities) > IDENTITY_CACHE:
            self._identities.popitem(last=False)
        return holder

    # -- the log -----------------------------------------------------------------------------------

    def _note(self) -> None:
        """Schedule the next log line: at once after a quiet spell, else LOG_EVERY_S after the last."""
        if self._flush is not None:
            return
        wait = max(0.0, self._last_log + LOG_EVERY_S - time.monotonic())
        self._flush = asyncio.get_running_loop().call_later(wait, self.flush_log)

    def flush_log(self) -> None:
        """Log what the guard did since the last line: one line per holder (address or team)."""
        self._flush = None
        tally, self.tally = self.tally, _Tally()
        if not tally:
            return
        self._last_log = time.monotonic()
        holders = (
            set(tally.reserve)
            | set(tally.refused_requests)
            | set(tally.evicted)
            | set(tally.refused)
            | set(tally.timed_out)
        )
        for holder in sorted(holders):
            parts = [
                f"{n} {what}"
                for n, what in (
                    (tally.reserve[holder], "opened over a cap"),
                    (tally.refused_requests[holder], "requests refused (429/503)"),
                    (tally.evicted[holder], "idle connections closed to make room"),
                    (tally.timed_out[holder], "closed without complete headers (408)"),
                    (tally.refused[holder], "refused (503, all busy)"),
                )
                if n
            ]
            log.warning(
                "connections %s: %s; %d open now (caps: %d per team, %d per address, %d unclaimed in total)",
                _shown(holder),
                ", ".join(parts),
                len(self.by_holder.get(holder, ())),
                self.per_team,
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

        def data_received(self, data: bytes) -> None:
            # uvicorn's protocols (httptools and h11 alike) make a new request cycle when a request's
            # head is complete, and only then schedule the application's task.
            before = getattr(self, "cycle", None)
            super().data_received(data)
            if getattr(self, "cycle", None) is not before:
                guard.head_received(self)

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


def model_server_guard(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> ConnectionGuard:
    """The connection limits of a model server (the vLLM gateway, the language-model server): request
    headers within ``header_timeout_s``, the total and per-address caps fitted to the open-file limit
    (raised to its hard limit), no teams and no cap on requests in flight beyond the connections (the
    server's key gate says who may call; its engine queues the work)."""
    guard, note = ConnectionGuard.fitted(
        raise_nofile_limit(),
        header_timeout_s=header_timeout_s,
        per_team_requests=DEFAULT_MAX_CONNECTIONS + DEFAULT_RESERVE,
        command=None,
    )
    if note is not None:
        logging.getLogger("gpuyard.serve").warning("%s", note)
    return guard


def keep_alive_s(guard: ConnectionGuard) -> int:
    """uvicorn's ``timeout_keep_alive`` under ``guard``: past the guard's header timeout, so that an idle
    kept-alive connection is closed by the guard (a 408 the client can read before reusing it), never
    silently by uvicorn at its default 5 s, the very age at which httpx (and the OpenAI client built on
    it) still reuses a pooled connection: a request sent as the server closes is reset (a lost request
    the client cannot tell from a crash; seen under load as ``httpx.ReadError``)."""
    return int(guard.header_timeout_s) + 5


def guarded_uvicorn(app: Any, guard: ConnectionGuard) -> dict[str, Any]:
    """The ``app``, ``http`` and ``timeout_keep_alive`` arguments of ``uvicorn.Config`` that serve
    ``app`` under ``guard``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return {
        "app": guard.wrap(app),
        "http": guarded_protocol(AutoHTTPProtocol, guard),
        "timeout_keep_alive": keep_alive_s(guard),
    }
