"""`gpuyard jobs`: submit, ls, show, whatif, logs, cancel against a gpuyard server."""

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


def resources_text(doc: dict[str, Any]) -> str:
    """What a job asks for, short: ``2``, ``0.5``, ``20 GB``, ``0.25, 10 GB``, ``MIG 1g.10gb``; an
    elastic job: what it holds (or waits for) and its range, ``4 (elastic 1-4)``."""
    res = (doc.get("spec") or {}).get("resources") or {}
    if res.get("gpus_max"):
        resize = f", restarts on {doc['resize_to']}" if doc.get("resize_to") else ""
        return f"{doc.get('gpus', res['gpus'])} (elastic {res['gpus']}-{res['gpus_max']}{resize})"
    if res.get("mig"):
        n = int(res.get("slices") or 1)
        return f"{n}x MIG {res['mig']}" if n > 1 else f"MIG {res['mig']}"
    parts = [f"{res['gpu_fraction']:g}"] if res.get("gpu_fraction") is not None else []
    if res.get("gpu_memory_gb") is not None:
        parts.append(f"{res['gpu_memory_gb']:g} GB")
    return ", ".join(parts) or str(doc.get("gpus", 0))


def placement_text(placement: dict[str, Any] | None) -> str:
    """Where a job runs, per node: ``local:0,1``, ``local:0 (0.5 of the GPU, 39.8 GB)``, MIG slices."""
    out = []
    for part in (placement or {}).get("nodes", []):
        gpus = ",".join(map(str, part.get("gpus") or []))
        if part.get("mig"):
            slices = ", ".join(f"MIG {m['profile']} {str(m['uuid'])[:13]}" for m in part["mig"])
            out.append(f"{part['node']}:{gpus} {slices}")
        elif part.get("share"):
            sh = part["share"]
            out.append(
                f"{part['node']}:{gpus} ({sh['fraction']:.3g} of the GPU, {sh.get('memory_gb', 0):.3g} GB)"
            )
        else:
            out.append(
                f"{part['node']}:{gpus}" if gpus else f"{part['node']} ({part.get('cpus', 0)} CPU slots)"
            )
    return "; ".join(out)


def _when(iso: str | None) -> str:
    return iso[:16].replace("T", " ") if iso else "unknown"


def _span(pair: list[str | None]) -> str:
    lo, hi = pair
    if lo == hi:
        return ""
    return f" ({_when(lo)} .. {_when(hi) if hi else 'no bound'})"


def eta_text(doc: dict[str, Any]) -> str:
    """The ``ls`` column: a queued job's predicted start, a running one's predicted end (UTC)."""
    p = doc.get("prediction")
    if not p:
        return ""
    if doc["state"] in ("scheduled", "running"):
        return f"ends {_when(p['end'])}"
    return f"starts {_when(p['start'])}"


def prediction_lines(p: dict[str, Any]) -> list[str]:
    """``jobs show``'s lines of a prediction: start and end with their ranges, and its source."""
    return [
        f"{'start':>12}  {_when(p['start'])}{_span(p['start_range'])} UTC (predicted)",
        f"{'end':>12}  {_when(p['end'])}{_span(p['end_range'])} UTC (predicted)",
        f"{'basis':>12}  {p['basis']}{': ' + p['note'] if p.get('note') else ''}",
    ]


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

    table = Table(
        "id", "name", "team", "state", "gpus", "where", "attempts", "submitted", "predicted", "reason"
    )
    for d in docs:
        active = d["state"] in ("scheduled", "running")
        table.add_row(
            str(d["id"]),
            d["name"],
            d["team"],
            d["state"],
            resources_text(d),
            placement_text(d["placement"]) if active else "",
            str(d["attempts"]),
            (d["submitted_at"] or "")[:19],
            eta_text(d),
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
        value = doc[key]
        if key == "gpus":
            value = resources_text(doc)
        elif key == "placement" and value:
            value = f"{placement_text(value)} ({value.get('how', '')})"
        elif key == "reason" and doc["state"] == "queued" and value:
            key, value = "waiting", value  # why it has not started
        typer.echo(f"{key:>12}  {value}")
    predicted = (doc["placement"] or {}).get("predicted")
    if predicted:  # fabric-aware placement: what the step model said about where it runs
        slower = predicted["step_s"] / predicted["consolidated_step_s"] - 1
        typer.echo(
            f"{'fabric':>12}  {predicted['where']}: predicted step {predicted['step_s']:.3g} s vs "
            f"{predicted['consolidated_step_s']:.3g} s on {predicted['consolidated']} ({slower:+.0%}); "
            f"{predicted['choice']}"
        )
    if doc.get("prediction"):
        for line in prediction_lines(doc["prediction"]):
            typer.echo(line)
    if doc.get("goodput"):
        from gpuyard.train.goodput import describe

        typer.echo(f"{'goodput':>12}  {describe(doc['goodput'])}")
    for e in doc["events"]:
        typer.echo(f"  {e['at'][:19]}  {e['from'] or '-':>9} -> {e['to']:<9}  {e['reason'] or ''}")


@jobs_app.command("whatif")
def whatif(
    spec: Path = typer.Argument(..., help="Job spec YAML."),
    server: str = _SERVER,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """When SPEC would start and end if submitted now, at several GPU counts side by side (as asked,
    half and twice; an elastic job its minimum and maximum). Nothing is submitted."""
    from gpuyard.scheduler.spec import load_spec

    doc = _client(server).whatif(load_spec(spec))
    if as_json:
        _echo_json(doc)
        return
    for shape in doc["shapes"]:
        size = f"{shape['gpus']:>4} GPUs, " if shape["gpus"] else ""  # a share: its shape says it all
        typer.echo(
            f"{size}{shape['shape']}: starts {_when(shape['start'])}"
            f"{_span(shape['start_range'])}, ends {_when(shape['end'])}{_span(shape['end_range'])} UTC"
            f" [{shape['basis']}{': ' + shape['note'] if shape.get('note') else ''}]"
        )


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
