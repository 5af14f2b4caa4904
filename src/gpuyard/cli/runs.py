"""`gpuyard runs`: list, show and compare tracked runs; draw their metric curves as PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gpuyard.errors import NotFoundError

runs_app = typer.Typer(
    help="Tracked runs: parameters, metric series, artifacts, lineage.", no_args_is_help=True
)


def console() -> Console:
    """A console that does not squeeze tables to 80 columns when output goes to a file or a pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=200)


def fmt(value: Any) -> str:
    """A cell for a table: "-" for None, 4 significant digits for floats."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _duration(doc: dict[str, Any]) -> str:
    from datetime import datetime

    if not doc.get("ended_at"):
        return "-"
    seconds = (
        datetime.fromisoformat(doc["ended_at"]) - datetime.fromisoformat(doc["started_at"])
    ).total_seconds()
    return f"{seconds:.1f}s"


def _default_columns(runs: list[Any]) -> list[str]:
    # The objective metric of the runs (their "metric" tag) on validation and test, else the first keys.
    objective = [r.tags.get("metric") for r in runs if r.tags.get("metric")]
    if objective:
        m = max(set(objective), key=objective.count)
        return [
            k for k in (f"validation/{m}", f"test/{m}", f"cv/{m}_mean") if any(k in r.latest for r in runs)
        ]
    return sorted({k for r in runs for k in r.latest})[:3]


@runs_app.command("ls")
def ls(
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Only this experiment."),
    status: str | None = typer.Option(None, "--status", help="running, finished, failed or pruned."),
    kind: str | None = typer.Option(None, "--kind", help="train, tune, trial, cv, fold, eval, retrain."),
    parent: str | None = typer.Option(None, "--parent", help="Only children of this run (trials, folds)."),
    team: str | None = typer.Option(None, "--team", help="Only this team's runs."),
    metric: list[str] = typer.Option([], "--metric", "-m", help="Metric columns to show (default: up to 4)."),
    limit: int = typer.Option(30, "--limit", "-n", help="How many runs, newest first."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List runs, newest first, with their latest metrics."""
    from gpuyard.models.runs import list_runs, resolve_run_id

    parent_id = resolve_run_id(parent) if parent else None
    runs = list_runs(
        experiment=experiment, status=status, kind=kind, parent_id=parent_id, limit=limit, team=team
    )
    if team and not runs:
        from gpuyard.auth import list_users
        from gpuyard.models.runs import run_teams

        known = run_teams() | {u["team"] for u in list_users()} | {"default"}
        if team not in known:
            raise NotFoundError(f"team {team!r} is unknown; known teams: {', '.join(sorted(known))}")
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in runs]))
        return
    keys = metric or _default_columns(runs)
    table = Table(show_lines=False)
    for col in ("id", "name", "team", "kind", "status", "dataset", "started"):
        table.add_column(col, no_wrap=True)
    for col in keys:
        table.add_column(col, justify="right", no_wrap=True)
    for r in runs:
        table.add_row(
            r.id[:8],
            r.name,
            r.team,
            r.kind,
            r.status,
            r.dataset_version or "-",
            r.started_at.strftime("%m-%d %H:%M:%S"),
            *(fmt(r.latest.get(k)) for k in keys),
        )
    console().print(table)


@runs_app.command("show")
def show(
    run: str = typer.Argument(..., help="Run id or a unique prefix of it."),
    plot: Path | None = typer.Option(None, "--plot", help="Also draw its metric curves into this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one run: lineage, parameters, latest metrics, evaluations, artifacts."""
    from gpuyard.models.runs import plot_curves, run_details
    from gpuyard.train.goodput import describe, of_run_doc

    doc = run_details(run)
    doc["goodput"] = of_run_doc(doc, live=True)  # from its folder while a launch still runs
    if plot is not None:
        doc["plot"] = str(plot_curves([doc["id"]], plot))
    if as_json:
        typer.echo(json.dumps(doc))
        return
    con = console()
    for key in (
        "id",
        "name",
        "experiment",
        "team",
        "kind",
        "status",
        "parent_id",
        "dataset_version",
        "code_version",
    ):
        con.print(f"[bold]{key:>16}[/bold]  {fmt(doc[key])}")
    con.print(f"[bold]{'duration':>16}[/bold]  {_duration(doc)}")
    if doc["goodput"]:
        con.print(f"[bold]{'goodput':>16}[/bold]  {describe(doc['goodput'])}")
    sysinfo = doc["system"]
    machine = f"{sysinfo.get('host')} python {sysinfo.get('python')} torch {sysinfo.get('torch', '-')}"
    con.print(
        f"[bold]{'machine':>16}[/bold]  {machine}, {sysinfo.get('cpus')} CPUs, {sysinfo.get('memory_gb')} GB"
    )
    if doc["system_metrics"]:
        last = ", ".join(f"{k[4:]}={fmt(v)}" for k, v in sorted(doc["system_metrics"].items()))
        con.print(f"[bold]{'system (last)':>16}[/bold]  {last}")
    if doc["error"]:
        con.print(f"[bold]{'error':>16}[/bold]  [red]{doc['error']}[/red]")
    for title, mapping in (
        ("params", doc["params"]),
        ("tags", doc["tags"]),
        ("latest metrics", doc["latest"]),
    ):
        if mapping:
            table = Table(title=title, title_justify="left")
            table.add_column("key")
            table.add_column("value", justify="right")
            for k, v in sorted(mapping.items()):
                table.add_row(k, fmt(v))
            con.print(table)
    for ev in doc["evaluations"]:
        con.print(
            f"[bold]evaluation[/bold] {ev['split']} ({ev['n']} samples, {ev['dataset_version'] or '-'}): "
            + ", ".join(f"{k}={fmt(v)}" for k, v in sorted(ev["metrics"].items()))
        )
        step = (ev["details"] or {}).get("step")
        for sample in (ev["details"] or {}).get("samples") or []:  # a language model's generations
            where = f"step {step}: " if step is not None else ""
            con.print(
                f"  {where}{sample.get('prompt')!r} -> {sample.get('completion')!r}",
                markup=False,
                highlight=False,
            )
    for art in doc["artifacts"]:
        con.print(f"[bold]artifact[/bold] {art['name']}  {art['size']} B  sha256:{art['sha256'][:12]}")
    if doc["children"]:
        con.print(
            f"[bold]children[/bold] {len(doc['children'])} runs (gpuyard runs ls --parent {doc['id'][:8]})"
        )
    if plot is not None:
        con.print(f"curves written to {doc['plot']}")


@runs_app.command("compare")
def compare(
    runs: list[str] = typer.Argument(..., help="Two or more run ids (or unique prefixes)."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Draw the runs' curves side by side into this PNG."
    ),
    metric: list[str] = typer.Option([], "--metric", "-m", help="Only these metrics in the plot."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Compare runs: parameters (differences marked) and latest metrics side by side."""
    from gpuyard.models.runs import compare_runs, plot_curves

    doc = compare_runs(runs)
    if plot is not None:
        doc["plot"] = str(plot_curves(doc["runs"], plot, keys=metric or None))
    if as_json:
        typer.echo(json.dumps(doc))
        return
    table = Table()
    table.add_column("")
    for run_id, name in zip(doc["runs"], doc["names"], strict=True):
        table.add_column(f"{run_id[:8]}\n{name}", justify="right")
    table.add_row("dataset", *(fmt(v) for v in doc["dataset_versions"]))
    for key, values in doc["params"].items():
        mark = "[yellow]*[/yellow] " if key in doc["differs"] else ""
        table.add_row(f"{mark}param {key}", *(fmt(v) for v in values))
    for key, values in doc["metrics"].items():
        table.add_row(f"metric {key}", *(fmt(v) for v in values))
    con = console()
    con.print(table)
    if plot is not None:
        con.print(f"curves written to {doc['plot']}")


@runs_app.command("best")
def best(
    metric: str = typer.Option(..., "--metric", "-m", help="accuracy, f1_macro, mse, ... or a logged key."),
    direction: str | None = typer.Option(
        None, "--direction", help="maximize or minimize (default: the metric's)."
    ),
    split: str = typer.Option("validation", "--split", help="Which split's value to compare."),
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Only this experiment."),
    parent: str | None = typer.Option(
        None, "--parent", help="Only children of this run (a search's trials)."
    ),
    kind: str | None = typer.Option(None, "--kind", help="Only this kind (train, trial, ...)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Select the best finished run by a declared metric and direction."""
    from gpuyard.models.runs import best_run, resolve_run_id

    parent_id = resolve_run_id(parent) if parent else None
    run, value = best_run(
        metric, direction, split=split, experiment=experiment, parent_id=parent_id, kind=kind
    )
    if as_json:
        typer.echo(json.dumps({"run": run.to_json(), "value": value}))
        return
    typer.echo(f"{run.id[:8]} {run.name} ({run.kind}) {metric}={value:.4f} params {json.dumps(run.params)}")


def register(app: typer.Typer) -> None:
    """Add `gpuyard runs` to the CLI."""
    app.add_typer(runs_app, name="runs")
