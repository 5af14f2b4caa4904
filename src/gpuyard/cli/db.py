"""`gpuyard db`: where the state store is and whether its schema is current."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape

db_app = typer.Typer(help="The state store (SQLite by default, PostgreSQL by GPUYARD_DATABASE_URL).")


@db_app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show the database URL (password masked), the artifact root and the schema revisions."""
    from gpuyard.settings import load_settings
    from gpuyard.store.db import get_store

    settings = load_settings()
    store = get_store(settings)
    current, heads = store.revision_status()
    doc = {
        "database": store.safe_url,
        "artifacts": settings.artifact_root,
        "home": str(settings.home),
        "revisions": sorted(current),
        "up_to_date": current == heads,
    }
    if as_json:
        typer.echo(json.dumps(doc))
        return
    console = Console()
    for key, value in doc.items():
        console.print(f"[bold]{key:>10}[/bold]  {escape(str(value))}")


@db_app.command("upgrade")
def upgrade() -> None:
    """Apply pending migrations (gpuyard also does this by itself on first use)."""
    from gpuyard.store.db import get_store

    store = get_store()
    store.migrate()
    current, _ = store.revision_status()
    typer.echo(f"{store.safe_url}: at {', '.join(sorted(current))}")


def register(app: typer.Typer) -> None:
    """Add `gpuyard db` to the CLI."""
    app.add_typer(db_app, name="db")
