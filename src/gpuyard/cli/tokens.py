"""`gpuyard tokens`: create (printed once), list and revoke API tokens, straight on the state store."""

from __future__ import annotations

import json

import typer

tokens_app = typer.Typer(help="API tokens (only their SHA-256 is stored; a token is printed once).")


@tokens_app.command("create")
def create(
    user: str = typer.Argument(..., help="User the token acts as."),
    label: str = typer.Option("", "--label", help="What the token is for."),
    expires_days: float = typer.Option(None, "--expires-days", help="Expire after this many days."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (the token under 'token')."),
) -> None:
    """Create a token for USER and print it; send it as 'Authorization: Bearer <token>'."""
    from gpuyard.auth import create_token

    token, doc = create_token(user, label, expires_days)
    typer.echo(json.dumps(doc | {"token": token}) if as_json else token)


@tokens_app.command("ls")
def ls(
    user: str = typer.Option(None, "--user", help="Only this user's tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List tokens (prefix, owner, dates; never the tokens themselves)."""
    from gpuyard.auth import list_tokens

    docs = list_tokens(user)
    if as_json:
        typer.echo(json.dumps(docs))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "user", "prefix", "label", "created", "expires", "last used", "revoked")
    for d in docs:
        table.add_row(
            str(d["id"]),
            d["user"],
            d["prefix"] + "...",
            d["label"],
            d["created_at"][:19],
            (d["expires_at"] or "-")[:19],
            (d["last_used_at"] or "-")[:19],
            "yes" if d["revoked"] else "",
        )
    Console().print(table)


@tokens_app.command("revoke")
def revoke(token_id: int = typer.Argument(..., help="Token id (see `gpuyard tokens ls`).")) -> None:
    """Revoke a token at once."""
    from gpuyard.auth import revoke_token

    doc = revoke_token(token_id)
    typer.echo(f"token {doc['id']} ({doc['prefix']}...) of {doc['user']} revoked")


def register(app: typer.Typer) -> None:
    """Add `gpuyard tokens` to the CLI."""
    app.add_typer(tokens_app, name="tokens")
