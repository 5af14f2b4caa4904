"""Who may call a model server, how large a body it reads, and how it stops.

Every model server gpuyard starts (``gpuyard serve``, ``gpuyard deploy``; classic and language models)
answers only callers that send ``Authorization: Bearer <key>`` where the key is one of:

- the server's own key: for a deployment, the key ``gpuyard deploy`` generated and showed once (the
  record keeps only its SHA-256); for ``gpuyard serve`` by hand, ``--api-key``, else the environment
  variable ``GPUYARD_SERVE_KEY``, else a key it generates and prints once on its terminal;
- a gpuyard API token (checked against the state store, as the API server checks it) of a user of
  the model's team, or of an admin. Another team's token gets 403; no key or an unknown one 401.

``/health`` and ``/ready`` stay open (liveness only: no model output, no traffic figures); every other
path, ``/metrics`` and ``/docs`` included, needs a key. The check runs before any body is read.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuyard.errors import ConfigError, GpuyardError

log = logging.getLogger("gpuyard.serve")

KEY_ENV = "GPUYARD_SERVE_KEY"
# The replicas of a `gpuyard serve` with several processes get the key's hash, never the key.
KEY_HASH_ENV = "GPUYARD_SERVE_KEY_SHA256"
TEAM_ENV = "GPUYARD_SERVE_TEAM"
TOKENS_ENV = "GPUYARD_SERVE_TOKENS"
KEY_PREFIX = "gyk_"
MIN_KEY_CHARS = 16
OPEN_PATHS = frozenset({"/health", "/ready"})
# A token checked against the store is trusted this long (a revoked token stops working within it).
TOKEN_CACHE_S = 10.0
_TOKEN_CACHE_MAX = 1024


class TooLarge(GpuyardError):
    """The body exceeds the server's ``max_body_bytes``."""

    http_status = 413


def new_key() -> str:
    """A fresh server key: ``gyk_`` + 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """The hex SHA-256 kept for a key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def check_key(key: str, where: str) -> str:
    """``key`` when it is usable as a server key.

    Raises:
        ConfigError: shorter than MIN_KEY_CHARS or with whitespace/control characters (``where`` says
            which flag or variable gave it; the key itself is never repeated).
    """
    if len(key) < MIN_KEY_CHARS or any(c.isspace() or not c.isprintable() for c in key):
        raise ConfigError(
            f"{where}: a server key needs at least {MIN_KEY_CHARS} printable characters without spaces"
        )
    return key


@dataclass(frozen=True)
class Access:
    """What a model server accepts as a key.

    Attributes:
        key_sha256: SHA-256 of the server's own key (None: no key of its own, only tokens).
        team: the team whose gpuyard tokens are accepted (admins' always are); None: admins only.
        tokens: whether gpuyard API tokens are checked against the state store at all.
    """

    key_sha256: str | None
    team: str | None = None
    tokens: bool = True

    def replica_env(self) -> dict[str, str]:
        """The environment that hands this access to replica processes (the key's hash, not the key)."""
        env = {KEY_HASH_ENV: self.key_sha256 or "", TEAM_ENV: self.team or ""}
        return env | {TOKENS_ENV: "1" if self.tokens else "0"}

    @classmethod
    def from_env(cls) -> Access:
        """The access a replica process was handed (:meth:`replica_env`)."""
        return cls(
            os.environ.get(KEY_HASH_ENV) or None,
            os.environ.get(TEAM_ENV) or None,
            os.environ.get(TOKENS_ENV, "1") == "1",
        )


def hand_key(api_key: str | None) -> tuple[str, bool]:
    """The key of a `gpuyard serve` started by hand: ``--api-key``, else $GPUYARD_SERVE_KEY, else a new
    one; and whether it was generated now (then the caller prints it once)."""
    if api_key:
        return check_key(api_key, "--api-key"), False
    env = os.environ.get(KEY_ENV, "").strip()
    if env:
        return check_key(env, KEY_ENV), False
    return new_key(), True


def announce_key(key: str) -> None:
    """Print a generated key once, on the terminal that started the server (never to a log)."""
    print(
        f"gpuyard serve: API key (shown once; send 'Authorization: Bearer <key>'; set {KEY_ENV} or "
        f"--api-key to choose one): {key}",
        file=sys.stderr,
        flush=True,
    )


class Verifier:
    """Checks a bearer value against an :class:`Access`: (status, message); status 0 means allowed."""

    def __init__(self, access: Access) -> None:
        self.access = access
        self._cache: dict[str, tuple[float, int, str]] = {}

    async def check(self, header: bytes | None) -> tuple[int, str]:
        """0 for an allowed caller, else 401/403/503 with a one-line reason."""
        scheme, _, value = (header or b"").decode("latin-1").strip().partition(" ")
        value = value.strip()
        if not header or scheme.lower() != "bearer" or not value:
            return 401, (
                "this model server needs a key: send 'Authorization: Bearer <key>' with the "
                "deployment's key or a gpuyard API token of the model's team"
            )
        digest = key_hash(value)
        if self.access.key_sha256 is not None and hmac.compare_digest(digest, self.access.key_sha256):
            return 0, ""
        if not self.access.tokens or not value.startswith("gy_"):
            return 401, "invalid key for this model server"
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        try:
            status, why = await asyncio.to_thread(self._token, value)
        except Exception as exc:  # the store is down or unreadable: say so, and do not cache it
            return 503, f"cannot check the token: the state store did not answer ({type(exc).__name__})"
        if status in (0, 403):
            if len(self._cache) >= _TOKEN_CACHE_MAX:
                self._cache.clear()
            self._cache[digest] = (now + TOKEN_CACHE_S, status, why)
        return status, why

    def _token(self, token: str) -> tuple[int, str]:
        from gpuyard.auth import authenticate
        from gpuyard.errors import AuthenticationError

        try:
            who = authenticate(token)
        except AuthenticationError as exc:
            return 401, str(exc)
        if who.is_admin or (self.access.team is not None and who.team == self.access.team):
            return 0, ""
        owner = f"team {self.access.team!r}" if self.access.team else "no team (admins only)"
        return 403, (f"this model server belongs to {owner}; user {who.user!r} is in team {who.team!r}")


ErrorBody = Callable[[int, str], bytes]


def detail_body(status: int, message: str) -> bytes:
    """``{"detail": message}``: the classic model server's error shape."""
    return json.dumps({"detail": message}).encode()


def openai_body(status: int, message: str) -> bytes:
    """The OpenAI API's error shape."""
    kind = {401: "authentication_error", 403: "permission_error", 413: "invalid_request_error"}
    err = {"message": message, "type": kind.get(status, "server_error"), "code": None, "param": None}
    return json.dumps({"error": err}).encode()


class KeyGate:
    """ASGI middleware: every request but :data:`OPEN_PATHS` needs a key (module docstring)."""

    def __init__(self, app: Any, access: Access, error_body: ErrorBody = detail_body) -> None:
        self.app, self.verifier, self.error_body = app, Verifier(access), error_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGI entry."""
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        status, why = await self.verifier.check(header)
        if status == 0:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: refuse the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_error(send, status, why, self.error_body)


async def send_error(send: Any, status: int, message: str, error_body: ErrorBody) -> None:
    """Answer ``status`` with ``message`` in the server's error shape."""
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, refused (:class:`TooLarge`) as soon as it passes ``limit`` bytes: a declared
    Content-Length over it is refused before anything is read."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise TooLarge(f"body of {length} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def draining_server(config: Any, inflight: Callable[[], str] | None = None) -> Any:
    """A uvicorn server that, on SIGTERM, waits at most ``config.timeout_graceful_shutdown`` seconds
    for requests in flight and logs one line saying what it waits for and one saying what it cut.

    ``inflight`` describes the work in flight (e.g. "3 decoding, 2 waiting"); empty when none.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):  # type: ignore[misc]
        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            limit = float(self.config.timeout_graceful_shutdown or 0)
            busy = inflight() if inflight else ""
            conns = len(self.server_state.connections)
            print(
                f"gpuyard serve: stopping; waiting up to {limit:g} s for {conns} open connection(s)"
                + (f" and the requests in flight ({busy})" if busy else ""),
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            self.cut: int | None = None
            await super().shutdown(sockets)
            waited = time.monotonic() - t0
            cut = self.cut
            if cut is not None:
                print(
                    f"gpuyard serve: stopped after {waited:.1f} s: the drain limit of {limit:g} s cut "
                    f"{cut} request(s) still answering" + (f" ({busy} when it began)" if busy else ""),
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(
                    f"gpuyard serve: stopped after {waited:.1f} s; nothing was cut",
                    file=sys.stderr,
                    flush=True,
                )

        async def _wait_tasks_to_complete(self) -> None:
            try:
                await super()._wait_tasks_to_complete()
            except asyncio.CancelledError:  # the drain limit: these requests are about to be cut
                self.cut = len(self.server_state.tasks)
                raise

    return DrainingServer(config)
