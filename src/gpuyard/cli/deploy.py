"""`gpuyard deploy`, `gpuyard undeploy`, `gpuyard deployments ls|show|alerts`: background model servers."""

from __future__ import annotations

import json
from typing import Any

import typer

deployments_app = typer.Typer(help="Model servers recorded in the state store.", no_args_is_help=True)


def _echo_json(doc: Any) -> None:
    typer.echo(json.dumps(doc))


def _table(docs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "id", "model", "version", "replicas", "device", "gpus", "job", "status", "url", "pids", "created"
    )
    for d in docs:
        pids = d["pids"].get("replicas") or ([d["pids"]["server"]] if d["pids"].get("server") else [])
        table.add_row(
            str(d["id"]),
            d["model"],
            str(d["version"]),
            str(d["replicas"]),
            d["device"],
            d["pids"].get("gpus") or "",
            "" if d["job"] is None else str(d["job"]),
            d["status"],
            d["url"] or "",
            ",".join(map(str, pids)),
            d["created_at"][:19],
        )
    Console().print(table)


def deploy(
    model: str = typer.Argument(..., help="NAME, NAME:VERSION or NAME@ALIAS."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(0, "--port", help="Port (0: any free port)."),
    replicas: int = typer.Option(
        1, "--replicas", help="Server processes (one per GPU where there are GPUs)."
    ),
    max_batch: int = typer.Option(32, "--max-batch", help="Most samples in one forward pass."),
    max_wait_ms: float = typer.Option(2.0, "--max-wait-ms", help="Longest wait for a batch to fill (ms)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    threads: int = typer.Option(
        0, "--threads", help="Torch threads per replica (0: (cores-1)/replicas, min 1)."
    ),
    no_drift: bool = typer.Option(False, "--no-drift", help="Do not monitor drift."),
    drift_window: int = typer.Option(1000, "--drift-window", help="Samples in the drift window."),
    drift_interval: float = typer.Option(5.0, "--drift-interval", help="Seconds between drift checks."),
    server: str = typer.Option(
        None, "--server", help="gpuyard server whose scheduler places GPU replicas (default: GPUYARD_SERVER)."
    ),
    team: str = typer.Option("default", "--team", help="Team the GPU job is charged to."),
    priority: int = typer.Option(0, "--priority", help="Priority of the GPU job (-1000..1000)."),
    max_restarts: int = typer.Option(2, "--max-restarts", help="Restarts of a GPU replica set that fails."),
    timeout: float = typer.Option(
        180.0, "--timeout", help="Seconds to wait for placement and readiness (then it is cancelled)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Start a model server in the background, record it, and wait until it is ready.

    With GPUs (--device cuda, or auto when the gpuyard server's nodes have GPUs) the replicas run as a
    scheduler job of one GPU per replica, placed by the scheduler; otherwise as processes here.
    """
    from gpuyard.serve.batching import BatchConfig
    from gpuyard.serve.deploy import deploy as run_deploy
    from gpuyard.serve.drift import DriftConfig
    from gpuyard.serve.runner import ServeOptions
    from gpuyard.serve.scheduled import Scheduling

    opts = ServeOptions(
        host=host,
        port=port,
        replicas=replicas,
        device=device,
        drift=not no_drift,
        drift_config=DriftConfig(
            window=drift_window, min_rows=min(200, drift_window), interval_s=drift_interval
        ),
        batch=BatchConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, threads=threads),
    )
    scheduling = Scheduling(server=server, team=team, priority=priority, max_restarts=max_restarts)
    doc = run_deploy(model, opts, timeout_s=timeout, scheduling=scheduling)
    if as_json:
        _echo_json(doc)
        return
    where = f"job {doc['job']}, GPUs {doc['pids'].get('gpus')}" if doc["job"] is not None else "here"
    typer.echo(
        f"deployment {doc['id']}: {doc['model']}:{doc['version']} running at {doc['url']} "
        f"({doc['replicas']} replica(s) on {doc['device']}; {where})"
    )


def undeploy(
    target: str = typer.Argument(..., help="A deployment id, or a model name (all its active deployments)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Stop a deployment (SIGTERM to its processes, SIGKILL after 15 s) and mark it stopped."""
    from gpuyard.serve.deploy import undeploy as run_undeploy

    docs = run_undeploy(target)
    if as_json:
        _echo_json(docs)
        return
    for d in docs:
        typer.echo(f"deployment {d['id']}: {d['model']}:{d['version']} {d['status']}")


@deployments_app.command("ls")
def ls(
    all_: bool = typer.Option(False, "--all", help="Include stopped, failed and dead deployments."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List deployments, newest first (servers whose process vanished are marked dead)."""
    from gpuyard.serve.deploy import list_deployments

    docs = list_deployments(all_=all_)
    if as_json:
        _echo_json(docs)
    else:
        _table(docs)


@deployments_app.command("show")
def show(deployment_id: int = typer.Argument(...)) -> None:
    """One deployment as JSON (its options, processes, log file)."""
    from gpuyard.serve.deploy import get_deployment

    _echo_json(get_deployment(deployment_id))


@deployments_app.command("alerts")
def alerts(
    model: str = typer.Argument(None, help="Only this model's alerts."),
    limit: int = typer.Option(50, "--limit", help="Most alerts shown."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Drift alerts recorded by the servers, newest first."""
    from gpuyard.serve.alerts import list_alerts

    docs = list_alerts(model, limit)
    if as_json:
        _echo_json(docs)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "model", "kind", "feature", "metric", "value", "threshold", "window", "retrain", "at")
    for d in docs:
        retrain = "" if d["retrain"] is None else ("error" if "error" in d["retrain"] else "called")
        table.add_row(
            str(d["id"]),
            f"{d['model']}:{d['version']}",
            d["kind"],
            d["feature"] or "",
            d["metric"],
            f"{d['value']:.4g}",
            f"{d['threshold']:.4g}",
            str(d["window"]),
            retrain,
            d["created_at"][:19],
        )
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add `gpuyard deploy`, `gpuyard undeploy` and `gpuyard deployments` to the CLI."""
    app.command("deploy")(deploy)
    app.command("undeploy")(undeploy)
    app.add_typer(deployments_app, name="deployments")
