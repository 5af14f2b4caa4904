"""`gpuyard tune SPEC.yaml` (Optuna search with a live table) and `gpuyard cv SPEC.yaml` (k-fold)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuyard.cli.models import print_feature_warnings
from gpuyard.models.features import describe

STATE_STYLE = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red", "RUNNING": "cyan", "WAITING": "dim"}


def _trial_table(rows: list[dict[str, Any]], title: str, direction: str) -> Table:
    keys = sorted({k for r in rows for k in r["params"]})
    table = Table(title=title, title_justify="left")
    for col in ("trial", "state", "value", "step", *keys, "run"):
        table.add_column(col, justify="right" if col not in ("state", "run") else "left", no_wrap=True)
    done = [r["value"] for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    best = (max(done) if direction == "maximize" else min(done)) if done else None
    for r in rows:
        style = STATE_STYLE.get(r["state"], "")
        value = "-" if r["value"] is None else f"{r['value']:.4f}"
        if best is not None and r["value"] == best:
            value = f"[bold]{value} *[/bold]"
        params = [
            f"{r['params'][k]:.4g}" if isinstance(r["params"].get(k), float) else str(r["params"].get(k, "-"))
            for k in keys
        ]
        table.add_row(
            str(r["number"]),
            f"[{style}]{r['state'].lower()}[/{style}]",
            value,
            "-" if r["step"] is None else str(r["step"]),
            *params,
            (r["run_id"] or "-")[:8],
        )
    return table


def tune_cmd(
    spec: Path = typer.Argument(..., help="Model spec YAML with a 'search' section."),
    executor: str = typer.Option(
        "pool",
        "--executor",
        help="pool (worker processes), subprocess, inline, or jobs (the gpuyard server's scheduler).",
    ),
    trials: int | None = typer.Option(None, "--trials", help="Override search.n_trials."),
    parallel: int | None = typer.Option(None, "--parallel", help="Override search.parallel."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document at the end (no live table)."),
) -> None:
    """Search hyperparameters with Optuna, each trial a job, trials in parallel, with a live table."""
    from rich.live import Live

    from gpuyard.models.spec import load_spec
    from gpuyard.models.tune import tune

    model_spec = load_spec(spec)
    if model_spec.search is not None and (trials or parallel):
        search = model_spec.search.model_copy(
            update={k: v for k, v in (("n_trials", trials), ("parallel", parallel)) if v}
        )
        model_spec = model_spec.model_copy(update={"search": search})
    title = f"{model_spec.name}: {model_spec.metric} ({model_spec.resolved_direction})"
    if as_json:
        result = tune(model_spec, executor_name=executor)
        print_feature_warnings(result.features)
        typer.echo(json.dumps(result.__dict__))
        return
    console = Console() if sys.stdout.isatty() else Console(width=200)
    with Live(
        _trial_table([], title, model_spec.resolved_direction), console=console, refresh_per_second=4
    ) as live:
        result = tune(
            model_spec,
            executor_name=executor,
            on_progress=lambda rows: live.update(_trial_table(rows, title, model_spec.resolved_direction)),
        )
    if not console.is_terminal:  # Live leaves its last frame without a line end when not on a terminal
        console.line()
    console.print(escape(describe(result.features)), soft_wrap=True)
    print_feature_warnings(result.features)
    console.print(
        f"best trial run {result.best_run_id[:8]}: validation {model_spec.metric}={result.best_value:.4f} "
        f"params {json.dumps(result.best_params)}"
    )
    console.print("test split: " + ", ".join(f"{k}={v:.4f}" for k, v in result.test_metrics.items()))
    console.print(
        f"search run {result.run_id[:8]} (study {result.study_name}); next: "
        f"gpuyard cv {spec} --params-from {result.best_run_id[:8]}"
    )


def cv_cmd(
    spec: Path = typer.Argument(..., help="Model spec YAML."),
    params_from: str | None = typer.Option(
        None, "--params-from", help="Use the params of this run (a tuned trial)."
    ),
    folds: int | None = typer.Option(None, "--folds", "-k", help="Number of folds (default: cv.folds or 5)."),
    parallel: int | None = typer.Option(
        None, "--parallel", help="Folds at once (default: cv.parallel or 1)."
    ),
    executor: str = typer.Option("pool", "--executor", help="pool, subprocess, inline or jobs (scheduler)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """k-fold cross-validation on train+validation, each fold a job; reports mean and std per metric."""
    from gpuyard.models.cv import cross_validate
    from gpuyard.models.spec import load_spec
    from gpuyard.models.tune import params_of_run

    model_spec = load_spec(spec)
    params = params_of_run(params_from) if params_from else {}
    result = cross_validate(model_spec, params, folds=folds, parallel=parallel, executor_name=executor)
    print_feature_warnings(result.features)
    if as_json:
        typer.echo(json.dumps(result.__dict__))
        return
    table = Table(
        title=f"{model_spec.name}: {len(result.fold_runs)}-fold CV on {result.dataset_version}",
        title_justify="left",
    )
    for col in ("metric", "mean", "std", *(f"fold {i}" for i in range(len(result.fold_runs)))):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for name, (mean, std) in result.summary.items():
        table.add_row(name, f"{mean:.4f}", f"{std:.4f}", *(f"{v:.4f}" for v in result.per_fold[name]))
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)
    console.print(escape(describe(result.features)), soft_wrap=True)
    console.print(f"cv run {result.run_id[:8]}")


def register(app: typer.Typer) -> None:
    """Add `gpuyard tune` and `gpuyard cv` to the CLI."""
    app.command("tune")(tune_cmd)
    app.command("cv")(cv_cmd)
