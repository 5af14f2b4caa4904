"""`gpuyard jobs`: submit, ls, show, logs, cancel against a gpuyard server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

jobs_app = typer.Typer(help="Jobs on a gpuyard server (default: the local one; GPUYARD_SERVER or --server).")
_SERVER = typer.Option(
    None, "--server", help="Server URL (default: GPUYARD_SERVER or http://127.0.0.1:8765)."
)


def _client(url: str | None) -> Any:
    from gpuyard.scheduler.client import JobClient
    from gpuyard.settings import load_settings

    return JobClient(url or load_settings().server_url)


def _echo_json(doc: Any) -> None:
    typer.echo(json.dumps(doc))


@jobs_app.command("submit")
def submit(
    spec: Path = typer.Argument(..., help="Job spec YAML."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show where it would run and what would launch."),
    server: str = _SERVER,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Submit SPEC (validated here first: a bad field is named before anything is sent)."""
    from gpuyard.scheduler.spec import load_spec

    job = load_spec(spec)
    client = _client(server)
    doc = client.dry_run(job) if dry_run else client.submit(job)
    if as_json or dry_run:
        _echo_json(doc)
    else:
        typer.echo(f"job {doc['id']} {doc['name']}: {doc['state']}")


@jobs_app.command("ls")
def ls(
    state: str = typer.Option(None, "--state", help="Only jobs in this state."),
    team: str = typer.Option(None, "--team", help="Only this team's jobs."),
    server: str = _SERVER,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List jobs, newest first."""
    docs = _client(server).list_jobs(state=state, team=team)
    if as_json:
        _echo_json(docs)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "name", "team", "state", "gpus", "attempts", "submitted", "reason")
    for d in docs:
        table.add_row(
            str(d["id"]),
            d["name"],
            d["team"],
            d["state"],
            str(d["gpus"]),
            str(d["attempts"]),
            (d["submitted_at"] or "")[:19],
            d["reason"] or "",
        )
    Console().print(table)


@jobs_app.command("show")
def show(
    job_id: int = typer.Argument(...),
    server: str = _SERVER,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """One job and its state changes."""
    client = _client(server)
    doc = client.get(job_id)
    doc["events"] = client.events(job_id)
    if as_json:
        _echo_json(doc)
        return
    for key in (
        "id",
        "name",
        "team",
        "user",
        "state",
        "gpus",
        "placement",
        "attempts",
        "preemptions",
        "exit_code",
        "reason",
        "log_path",
    ):
        typer.echo(f"{key:>12}  {doc[key]}")
    predicted = (doc["placement"] or {}).get("predicted")
    if predicted:  # fabric-aware placement: what the step model said about where it runs
        slower = predicted["step_s"] / predicted["consolidated_step_s"] - 1
        typer.echo(
            f"{'fabric':>12}  {predicted['where']}: predicted step {predicted['step_s']:.3g} s vs "
            f"{predicted['consolidated_step_s']:.3g} s on {predicted['consolidated']} ({slower:+.0%}); "
            f"{predicted['choice']}"
        )
    for e in doc["events"]:
        typer.echo(f"  {e['at'][:19]}  {e['from'] or '-':>9} -> {e['to']:<9}  {e['reason'] or ''}")


@jobs_app.command("logs")
def logs(
    job_id: int = typer.Argument(...),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing until the job ends."),
    server: str = _SERVER,
) -> None:
    """Print a job's output (stdout and stderr)."""
    for chunk in _client(server).logs(job_id, follow=follow):
        sys.stdout.write(chunk)
        sys.stdout.flush()


@jobs_app.command("cancel")
def cancel(
    job_id: int = typer.Argument(...),
    server: str = _SERVER,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Cancel a job (running: SIGTERM, then SIGKILL after the server's grace period)."""
    doc = _client(server).cancel(job_id)
    if as_json:
        _echo_json(doc)
    else:
        typer.echo(f"job {doc['id']}: {doc['state']}" + (" (stopping)" if doc["stop_requested"] else ""))


def register(app: typer.Typer) -> None:
    """Add `gpuyard jobs` to the CLI."""
    app.add_typer(jobs_app, name="jobs")
