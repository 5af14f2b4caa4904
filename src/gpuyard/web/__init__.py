"""The web dashboard: one page and its scripts, all served by gpuyard itself (no CDN).

The page holds no data: it asks the API with the token the user pasted (kept in the browser's
localStorage and sent as ``Authorization: Bearer``), so every data route stays behind the token
while the page and its static files load without one.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).parent


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard at ``/`` and its files at ``/static``."""
    app.mount("/static", StaticFiles(directory=WEB_DIR / "static"), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(WEB_DIR / "templates" / "index.html", headers={"Cache-Control": "no-cache"})
