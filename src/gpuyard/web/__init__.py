"""The web dashboard: one page and its scripts, all served by gpuyard itself (no CDN).

The page holds no data: it asks the API with the token the user pasted (kept in the browser's
localStorage and sent as ``Authorization: Bearer``), so every data route stays behind the token
while the page and its static files load without one.

Every response of the server says ``X-Content-Type-Options: nosniff`` and may not be framed
(``frame-ancestors 'none'``, ``X-Frame-Options: DENY``); the dashboard's page and files also carry a
strict Content-Security-Policy: scripts, styles and API calls from this server only, no inline script
or style (the pages set computed widths and colours through the DOM: ``data-css``), no plugins. Every
value a page renders goes through ``esc`` or ``textContent``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).parent

# The dashboard's policy. img-src data: is the page's empty favicon; uPlot draws on a canvas.
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
# Every other response (JSON, /docs): no framing, no sniffing.
DEFAULT_CSP = "frame-ancestors 'none'"
DASHBOARD_PATHS = ("/static/",)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SecurityHeaders:
    """Add the dashboard's security headers to every HTTP response (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        csp = DASHBOARD_CSP if path == "/" or path.startswith(DASHBOARD_PATHS) else DEFAULT_CSP
        extra = [
            (b"content-security-policy", csp.encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"no-referrer"),
        ]

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []), *(h for h in extra if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, with_headers)


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard at ``/`` and its files at ``/static``, every response with security headers."""
    app.add_middleware(SecurityHeaders)
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(WEB_DIR / "templates" / "index.html", headers={"Cache-Control": "no-cache"})
