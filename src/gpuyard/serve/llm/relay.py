"""The gateway's path to a vLLM replica: raw HTTP/1.1 over kept-alive loopback connections.

The gateway checks a request once (key, body, fields; :mod:`gpuyard.serve.llm.gateway`), then this
module sends it to the replica with the replica's key and hands the answer back. A streamed answer's
bytes are relayed as they arrive with the least work per read: the upstream ``Transfer-Encoding:
chunked`` framing is undone (:class:`Dechunker`, a few ``bytes.find`` calls per read, several events at
once when they queued up) and the payload goes to the client in one ASGI message, whose server frames
it again. No HTTP client library and no Starlette streaming machinery sit in that path: measured on
this project's 2-core machine, they cost about 285 µs of the gateway's CPU per streamed token, which
vLLM needed (benchmarks/llm_serve.py, BENCHMARKS.md).

Every read is bounded: a response head over :data:`MAX_HEAD_BYTES`, a malformed status line or chunk
size, and a connection that ends before the last chunk are a failed replica (:class:`UpstreamError`).
A connection goes back to its replica's pool only after a complete response; one that was idle longer
than vLLM's keep-alive window is not reused but closed (:meth:`Upstream.reap`, on every return to the
pool and every half second from the gateway's watcher), so the pool holds no replica's closed ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

# The longest response head a replica may send.
MAX_HEAD_BYTES = 64 * 1024
# The longest non-streamed body a replica may send (a completion with logprobs of a long reply).
MAX_BODY_BYTES = 256 * 1024 * 1024
# vLLM's server (uvicorn) closes a kept-alive connection after 5 s idle: reuse within less.
IDLE_REUSE_S = 3.0
# Idle connections kept per replica.
POOL_SIZE = 256
CONNECT_TIMEOUT_S = 10.0
READ_CHUNK = 64 * 1024


class UpstreamError(Exception):
    """The replica's connection failed or it answered something that is not HTTP/1.1 as expected."""


class Dechunker:
    """Undoes ``Transfer-Encoding: chunked`` incrementally: :meth:`feed` returns the payload bytes
    complete so far; :attr:`done` once the terminating chunk and its trailer have been read."""

    __slots__ = ("_trailer", "buf", "done", "left")

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0  # payload bytes still due in the current chunk (then its CRLF)
        self.done = False
        self._trailer = False

    def feed(self, data: bytes) -> bytes:
        """The payload in ``data`` (plus what was held back from earlier reads).

        Raises:
            UpstreamError: a malformed chunk size or framing.
        """
        buf = self.buf + data if self.buf else data
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self.left > 0:
                take = min(self.left, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.left -= take
                if self.left:
                    break
                self.left = -2  # the chunk's CRLF is due
                continue
            if self.left == -2:
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise UpstreamError("malformed chunked framing (no CRLF after a chunk)")
                pos += 2
                self.left = 0
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if n - pos > 1024:
                    raise UpstreamError("malformed chunked framing (a chunk size line over 1 KiB)")
                break
            if self._trailer:  # after the last chunk: trailer lines, then an empty one
                self.done = end == pos
                pos = end + 2
                continue
            size_text = buf[pos:end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise UpstreamError(f"malformed chunk size {size_text[:40]!r}") from None
            if size < 0:
                raise UpstreamError(f"malformed chunk size {size_text[:40]!r}")
            pos = end + 2
            if size == 0:
                self._trailer = True
                continue
            self.left = size
        self.buf = buf[pos:] if pos < n else b""
        return b"".join(out) if len(out) != 1 else out[0]


@dataclass(frozen=True)
class Head:
    """A response's status line and the headers the relay needs.

    Attributes:
        status: the status code.
        content_type: its Content-Type (``application/json`` when absent).
        chunked: ``Transfer-Encoding: chunked``.
        length: its Content-Length (None: chunked, or delimited by the connection's end).
        keep_alive: the connection may carry another request afterwards.
    """

    status: int
    content_type: str
    chunked: bool
    length: int | None
    keep_alive: bool


def parse_head(raw: bytes) -> Head:
    """The :class:`Head` of a response head (up to and including its empty line).

    Raises:
        UpstreamError: not an HTTP/1.x status line, or a malformed Content-Length.
    """
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise UpstreamError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    kind, chunked, length, keep = "application/json", False, None, version == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name, value = name.strip().lower(), value.strip()
        if name == b"content-type":
            kind = value.decode("latin-1")
        elif name == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
        elif name == b"content-length":
            if not value.isdigit():
                raise UpstreamError(f"malformed Content-Length {value[:40]!r}")
            length = int(value)
        elif name == b"connection":
            keep = value.lower() != b"close"
    if chunked:
        length = None
    elif length is None:
        keep = False  # delimited by the connection's end
    return Head(int(code), kind, chunked, length, keep)


@dataclass
class Upstream:
    """One replica's address and its idle kept-alive connections."""

    host: str
    port: int
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = field(default_factory=list)

    async def _connect(self) -> tuple[bool, asyncio.StreamReader, asyncio.StreamWriter]:
        """(reused, reader, writer): an idle connection young enough, else a new one."""
        now = time.monotonic()
        while self.idle:
            r, w, since = self.idle.pop()
            if now - since < IDLE_REUSE_S and not w.is_closing() and not r.at_eof():
                return True, r, w
            w.transport.abort()
        try:
            r, w = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES), CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect: {exc}") from None
        return False, r, w

    async def open(self, request: bytes) -> tuple[Head, asyncio.StreamReader, asyncio.StreamWriter]:
        """Send ``request`` (a whole HTTP/1.1 request) and read its response's head.

        A kept-alive connection that the replica closed while idle is retried once on a new one
        (nothing was answered on it, so nothing was done).

        Raises:
            UpstreamError: the connection failed, or the head is malformed or over MAX_HEAD_BYTES.
        """
        for attempt in (0, 1):
            reused, r, w = await self._connect()
            try:
                w.write(request)
                await w.drain()
                raw = await r.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                w.transport.abort()
                raise UpstreamError(f"a response head over {MAX_HEAD_BYTES} bytes") from None
            except (asyncio.IncompleteReadError, OSError) as exc:
                w.transport.abort()
                partial = getattr(exc, "partial", b"")
                if reused and attempt == 0 and not partial:
                    continue
                why = type(exc).__name__
                raise UpstreamError(f"the connection ended before a response ({why})") from None
            except BaseException:
                w.transport.abort()
                raise
            try:
                return parse_head(raw), r, w
            except UpstreamError:
                w.transport.abort()
                raise
        raise AssertionError("unreachable")

    def put_back(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """Keep a connection whose response was read completely for the next request."""
        self.reap()
        if len(self.idle) < POOL_SIZE and not w.is_closing() and not r.at_eof():
            self.idle.append((r, w, time.monotonic()))
        else:
            w.transport.abort()

    def reap(self) -> None:
        """Close the idle connections too old to reuse (the oldest are first: :meth:`_connect` takes
        the newest), so that a pool that was once large does not hold the replica's closed ends."""
        now = time.monotonic()
        stale = 0
        while stale < len(self.idle) and now - self.idle[stale][2] >= IDLE_REUSE_S:
            self.idle[stale][1].transport.abort()
            stale += 1
        if stale:
            del self.idle[:stale]

    def close(self) -> None:
        """Drop every idle connection (the replica is being replaced, or the gateway stops)."""
        for _, w, _ in self.idle:
            w.transport.abort()
        self.idle.clear()

    async def read_body(self, head: Head, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bytes:
        """The whole body of a response (the connection kept for reuse when it allows).

        Raises:
            UpstreamError: the connection ended early, or the body is over MAX_BODY_BYTES.
        """
        try:
            if head.chunked:
                dech, parts, size = Dechunker(), [], 0
                while not dech.done:
                    data = await r.read(READ_CHUNK)
                    if not data:
                        raise UpstreamError("the connection ended inside a chunked body")
                    part = dech.feed(data)
                    size += len(part)
                    if size > MAX_BODY_BYTES:
                        raise UpstreamError(f"a response body over {MAX_BODY_BYTES} bytes")
                    parts.append(part)
                body, clean = b"".join(parts), not dech.buf
            elif head.length is not None:
                if head.length > MAX_BODY_BYTES:
                    raise UpstreamError(f"a response body of {head.length} bytes")
                body, clean = await r.readexactly(head.length), True
            else:
                body = await r.read(MAX_BODY_BYTES + 1)
                while True:  # until the connection ends
                    more = await r.read(READ_CHUNK)
                    if not more:
                        break
                    body += more
                    if len(body) > MAX_BODY_BYTES:
                        raise UpstreamError(f"a response body over {MAX_BODY_BYTES} bytes")
                clean = False
        except asyncio.IncompleteReadError:
            w.transport.abort()
            raise UpstreamError("the connection ended inside a response body") from None
        except OSError as exc:
            w.transport.abort()
            raise UpstreamError(f"the connection failed inside a response body ({exc})") from None
        except BaseException:
            w.transport.abort()
            raise
        if clean and head.keep_alive:
            self.put_back(r, w)
        else:
            w.transport.abort()
        return body


def request_bytes(path: str, port: int, key: str, body: bytes) -> bytes:
    """A POST of JSON ``body`` to ``path`` on a loopback replica, with its key."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def abort(w: asyncio.StreamWriter) -> None:
    """Close a connection at once (a replica sees its client gone and aborts the request)."""
    with contextlib.suppress(Exception):
        w.transport.abort()
