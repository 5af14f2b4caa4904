"""`gpuyard users`: add, list and remove API users (team and role), straight on the state store."""

from __future__ import annotations

import json

import typer

users_app = typer.Typer(help="API users: their team and role (admin, member, viewer).")


@users_app.command("add")
def add(
    name: str = typer.Argument(..., help="User name."),
    team: str = typer.Option("default", "--team", help="Team whose jobs the user sees and submits."),
    role: str = typer.Option("member", "--role", help="admin, member or viewer."),
    token: bool = typer.Option(False, "--token", help="Also create a token and print it (shown once)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Create a user (the store is GPUYARD_HOME's SQLite or GPUYARD_DATABASE_URL)."""
    from gpuyard.auth import add_user, create_token

    doc = add_user(name, team, role)
    if token:
        doc["token"], _ = create_token(name, label="created with the user")
    if as_json:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"user {doc['name']}: team {doc['team']}, role {doc['role']}")
    if token:
        typer.echo(doc["token"])


@users_app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List users."""
    from gpuyard.auth import list_users

    docs = list_users()
    if as_json:
        typer.echo(json.dumps(docs))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "team", "role", "created")
    for d in docs:
        table.add_row(d["name"], d["team"], d["role"], d["created_at"][:19])
    Console().print(table)


@users_app.command("rm")
def rm(name: str = typer.Argument(..., help="User name.")) -> None:
    """Remove a user and every token of theirs."""
    from gpuyard.auth import remove_user

    remove_user(name)
    typer.echo(f"user {name} removed")


def register(app: typer.Typer) -> None:
    """Add `gpuyard users` to the CLI."""
    app.add_typer(users_app, name="users")
