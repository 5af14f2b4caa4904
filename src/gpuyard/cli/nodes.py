"""`gpuyard nodes`: the scheduler's nodes and their health (ls, show), drain and undrain (admins)."""

from __future__ import annotations

import json
from typing import Any

import typer

nodes_app = typer.Typer(help="Nodes of a gpuyard server and their health: healthy, degraded or drained.")
_SERVER = typer.Option(
    None, "--server", help="Server URL (default: GPUYARD_SERVER or http://127.0.0.1:8765)."
)


def _client(url: str | None) -> Any:
    from gpuyard.scheduler.client import JobClient
    from gpuyard.settings import load_settings

    return JobClient(url or load_settings().server_url)


def _call(server: str | None, method: str, path: str, **kwargs: Any) -> Any:
    client = _client(server)
    try:
        return client._call(method, path, **kwargs)
    finally:
        client.close()


@nodes_app.command("ls")
def ls(server: str = _SERVER, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the nodes: state, since when, why, GPUs and the jobs on each."""
    docs = _call(server, "GET", "/nodes")
    if as_json:
        typer.echo(json.dumps(docs))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("node", "state", "since", "gpus", "jobs", "last check", "reason")
    for d in docs:
        table.add_row(
            d["node"],
            d["state"],
            (d["since"] or "")[:19],
            f"{d['gpus']} {d['gpu_type']}".strip(),
            ",".join(map(str, d["jobs"])),
            (d["checked_at"] or "never")[:19],
            d["reason"] or "",
        )
    Console().print(table)


@nodes_app.command("show")
def show(
    node: str = typer.Argument(..., help="Node name (as `gpuyard nodes ls` shows it)."),
    server: str = _SERVER,
) -> None:
    """One node's state, last health check and history, as JSON."""
    typer.echo(json.dumps(_call(server, "GET", f"/nodes/{node}"), indent=2))


@nodes_app.command("drain")
def drain(
    node: str = typer.Argument(..., help="Node name."),
    reason: str = typer.Option(..., "--reason", help="Why (kept in the node's history)."),
    server: str = _SERVER,
) -> None:
    """Drain NODE (admin): nothing new starts there; its preemptible jobs checkpoint and requeue."""
    doc = _call(server, "POST", f"/nodes/{node}/drain", json={"reason": reason})
    moving = f"; jobs on it: {', '.join(map(str, doc['jobs']))}" if doc["jobs"] else ""
    typer.echo(f"node {doc['node']}: {doc['state']} ({doc['reason']}){moving}")


@nodes_app.command("undrain")
def undrain(
    node: str = typer.Argument(..., help="Node name."),
    reason: str = typer.Option("", "--reason", help="Why it goes back into service."),
    server: str = _SERVER,
) -> None:
    """Put drained NODE back into service (admin); the next health check grades it again."""
    doc = _call(server, "POST", f"/nodes/{node}/undrain", json={"reason": reason})
    typer.echo(f"node {doc['node']}: {doc['state']}")


def register(app: typer.Typer) -> None:
    """Add `gpuyard nodes` to the CLI."""
    app.add_typer(nodes_app, name="nodes")
