"""`gpuyard deploy`, `gpuyard undeploy`, `gpuyard deployments ls|show|alerts`: background model servers."""

from __future__ import annotations

import json
from typing import Any

import typer

from gpuyard.cli.serve import with_serve_flags
from gpuyard.serve.options import ServeOptions

deployments_app = typer.Typer(help="Model servers recorded in the state store.", no_args_is_help=True)


def _echo_json(doc: Any) -> None:
    typer.echo(json.dumps(doc))


def _print(table: Any) -> None:
    from rich.console import Console

    # Wide enough for every column: an 80-column pipe or terminal would cut the URLs to "htt…".
    Console(width=max(Console().width, 160)).print(table)


def _served(d: dict[str, Any]) -> str:
    """A deployment's model, and the LoRA adapters it serves by name beside it (``base:1 + a:1``)."""
    return f"{d['model']}:{d['version']}" + "".join(f" + {a}" for a in d.get("adapters") or ())


def _table(docs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    scheduled = any(d["job"] is not None for d in docs)  # GPU columns only where the scheduler placed any
    table = Table("id", "model", "replicas", "device", *(("gpus", "job") if scheduled else ()), "status")
    table.add_column("url", no_wrap=True)
    table.add_column("pids")
    table.add_column("created (UTC)", no_wrap=True)
    for d in docs:
        pids = d["pids"].get("replicas") or ([d["pids"]["server"]] if d["pids"].get("server") else [])
        placed = (d["pids"].get("gpus") or "", "" if d["job"] is None else str(d["job"]))
        table.add_row(
            str(d["id"]),
            _served(d),
            str(d["replicas"]),
            d["device"],
            *(placed if scheduled else ()),
            d["status"],
            d["url"] or "",
            ",".join(map(str, pids)),
            d["created_at"][:19].replace("T", " "),
        )
    _print(table)


@with_serve_flags(port=0, port_help="Port (0: any free port).")
def deploy(
    opts: ServeOptions,
    model: str = typer.Argument(..., help="NAME, NAME:VERSION or NAME@ALIAS."),
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

    Prints the deployment's key once (the record keeps only its hash): callers send it, or a gpuyard
    token of the model's team, as 'Authorization: Bearer'.

    With GPUs (--device cuda, or auto when the gpuyard server has GPUs): a scheduler job, one GPU a replica.
    Otherwise: processes on this machine. `gpuyard deployments show ID` prints the recorded options.

    A language model with --adapter A:1 --adapter B:2 (vLLM): its base serves the registered LoRA
    adapters by name, all in one deployment; the record lists them (`adapters`).
    """
    from gpuyard.serve.deploy import deploy as run_deploy
    from gpuyard.serve.scheduled import Scheduling

    scheduling = Scheduling(server=server, team=team, priority=priority, max_restarts=max_restarts)
    doc = run_deploy(model, opts, timeout_s=timeout, scheduling=scheduling)
    if as_json:
        _echo_json(doc)
        return
    typer.echo(
        f"deployment {doc['id']}: {doc['model']}:{doc['version']} running at {doc['url']} ({_where(doc)})"
    )
    from gpuyard.models.llm import ADAPTER_FLAVOR, FLAVOR
    from gpuyard.models.registry import get_version

    mv = get_version(f"{doc['model']}:{doc['version']}")
    if mv.flavor in (FLAVOR, ADAPTER_FLAVOR):
        models = f"model {doc['ref']!r}"
        if doc["adapters"]:  # vLLM serves the base, and each adapter by name on it
            base = mv.config["base"] if mv.flavor == ADAPTER_FLAVOR else mv.ref
            ads = ([mv.ref] if mv.flavor == ADAPTER_FLAVOR else []) + doc["adapters"]
            models = f"model {base!r}, or a LoRA adapter of it: {', '.join(map(repr, ads))}"
        use = f"OpenAI API at {doc['url']}/v1 ({models}: /v1/completions, /v1/chat/completions)"
    else:
        use = f"predict: POST {doc['url']}/v1/models/{doc['model']}/predict"
    typer.echo(f"  {use}  stop: gpuyard undeploy {doc['id']}")
    typer.echo(
        f"  key (shown once; send 'Authorization: Bearer <key>', or a gpuyard token of team "
        f"{doc['team']!r}): {doc['api_key']}"
    )


def _where(doc: dict[str, Any]) -> str:
    """How many replicas run on what, and where: a scheduler job's GPUs, or this machine's processes."""
    n = doc["replicas"]
    replicas = f"{n} replica{'s' if n != 1 else ''} on {doc['device']}"
    if doc["job"] is not None:
        return f"{replicas}; job {doc['job']}, GPUs {doc['pids'].get('gpus')}"
    return f"{replicas}, started on this machine; log: {doc['log']}"


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
    from gpuyard.serve.records import ACTIVE

    docs = list_deployments(all_=True)
    shown = docs if all_ else [d for d in docs if d["status"] in ACTIVE]
    if as_json:
        _echo_json(shown)
        return
    _table(shown)
    if len(shown) < len(docs):
        typer.echo(f"({len(docs) - len(shown)} stopped, failed or dead not shown: --all lists them)")


@deployments_app.command("show")
def show(deployment_id: int = typer.Argument(...)) -> None:
    """One deployment as JSON (its options, processes, log file)."""
    from gpuyard.serve.records import get_deployment

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
    from rich.table import Table

    table = Table(
        "id", "model", "kind", "feature", "metric", "value", "threshold", "window", "retrain", "at (UTC)"
    )
    for d in docs:
        retrain = "" if d["retrain"] is None else ("error" if "error" in d["retrain"] else "called")
        table.add_row(
            str(d["id"]),
            _served(d),
            d["kind"],
            d["feature"] or "",
            d["metric"],
            f"{d['value']:.4g}",
            f"{d['threshold']:.4g}",
            str(d["window"]),
            retrain,
            d["created_at"][:19].replace("T", " "),
        )
    _print(table)


def register(app: typer.Typer) -> None:
    """Add `gpuyard deploy`, `gpuyard undeploy` and `gpuyard deployments` to the CLI."""
    app.command("deploy")(deploy)
    app.command("undeploy")(undeploy)
    app.add_typer(deployments_app, name="deployments")
