"""The request-body cap: an ASGI middleware that answers 413 or 408 before a route sees the request.

A declared ``Content-Length`` over the cap is refused at once, without reading a byte of the body; a
chunked body is read only up to the cap. The whole body must arrive within ``timeout_s`` of the
request's start, so a client that trickles bytes, or never finishes, is answered 408 and cut off
instead of holding a connection forever. The body read here is handed on to the application
unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Cap request bodies at ``max_bytes`` (``route_limits``: a larger or smaller cap per path prefix)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        route_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        # Longest prefix first, so /a/b's cap wins over /a's.
        self.route_limits = sorted((route_limits or {}).items(), key=lambda kv: -len(kv[0]))

    def limit_for(self, path: str) -> int:
        """The cap for a request to ``path``."""
        for prefix, limit in self.route_limits:
            if path.startswith(prefix):
                return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared == -1:
            await _answer(send, 400, "Content-Length: not a non-negative integer")
            return
        if declared is not None and declared > limit:
            await _answer(send, 413, _too_large(declared, limit))
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client went away: nothing to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await _answer(send, 413, _too_large(size, limit, more=True))
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _answer(
                send, 408, f"request body: not received within {self.timeout_s:g} s ({size} bytes arrived)"
            )
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when malformed."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) <= 20 else -1
    return None


def _too_large(size: int, limit: int, more: bool = False) -> str:
    got = f"more than {limit}" if more else str(size)
    return (
        f"request body: {got} bytes; this server takes at most {limit} bytes (gpuyard server --max-body-mb)"
    )


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
