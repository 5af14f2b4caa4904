"""`gpuyard models`: fit, register, list, show, alias, stage, promote, export, optimize and retrain models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from gpuyard.cli.runs import console, fmt
from gpuyard.models.features import describe


def print_feature_warnings(features: dict[str, Any]) -> None:
    """One warning line on stderr per column a fit, cv or tune left out, and per note about its data
    (see gpuyard.models.features)."""
    from rich.console import Console

    err = Console(stderr=True)
    for name, why in (features.get("dropped") or {}).items():
        line = f"[yellow]warning:[/yellow] column {escape(repr(name))} not used: {escape(why)}"
        err.print(line, soft_wrap=True)
    for note in features.get("notes") or []:
        err.print(f"[yellow]warning:[/yellow] {escape(note)}", soft_wrap=True)


models_app = typer.Typer(
    help="The model registry: versions, lineage, aliases, stages, promotion.", no_args_is_help=True
)


@models_app.command("fit")
def fit_cmd(
    spec: Path = typer.Argument(..., help="Model spec YAML (dataset, trainer, params, metric)."),
    params_from: str | None = typer.Option(
        None, "--params-from", help="Take params from this run (a tuned trial)."
    ),
    register_as: str | None = typer.Option(
        None, "--register", help="Register the fitted model under this name."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Train one model from SPEC as a tracked run; evaluate validation and test apart; store the model."""
    from gpuyard.models.fit import fit
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.spec import load_spec
    from gpuyard.models.tune import params_of_run

    model_spec = load_spec(spec)
    params = params_of_run(params_from) if params_from else {}
    result, _ = fit(model_spec, params)
    doc: dict[str, Any] = {
        "run_id": result.run_id,
        "status": result.status,
        "evaluations": result.evaluations,
        "features": result.features,
    }
    if register_as:
        doc["registered"] = register_from_run(register_as, result.run_id).ref
    print_feature_warnings(result.features)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    con = console()
    con.print(f"run {result.run_id[:8]} {result.status}")
    con.print(escape(describe(result.features)), soft_wrap=True)
    for split, metrics in result.evaluations.items():
        con.print(f"  {split:>10}: " + ", ".join(f"{k}={fmt(v)}" for k, v in metrics.items()))
    if register_as:
        con.print(f"registered {doc['registered']}")


@models_app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List registered models: versions, latest, production, staging, aliases."""
    from gpuyard.models.registry import list_models

    models = list_models()
    if as_json:
        typer.echo(json.dumps(models))
        return
    table = Table()
    for col in ("name", "flavor", "versions", "latest", "production", "staging", "aliases", "updated"):
        table.add_column(col, no_wrap=True)
    for m in models:
        aliases = ", ".join(f"{a}->v{v}" for a, v in sorted(m["aliases"].items()))
        table.add_row(
            m["name"],
            m["flavor"],
            str(m["versions"]),
            fmt(m["latest"]),
            fmt(m["production"]),
            fmt(m["staging"]),
            aliases or "-",
            m["updated_at"][:19],
        )
    console().print(table)


@models_app.command("show")
def show(
    ref: str = typer.Argument(..., help="NAME (all versions), NAME:VERSION or NAME@ALIAS."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a model's versions, or one version with its lineage, signature, metrics and files."""
    from gpuyard.models.registry import get_version, list_versions, model_events
    from gpuyard.refs import ModelRef

    parsed = ModelRef.parse(ref)
    name = parsed.name
    if parsed.selector is None:
        versions = list_versions(name)
        if as_json:
            typer.echo(
                json.dumps(
                    {"name": name, "versions": [v.to_json() for v in versions], "events": model_events(name)}
                )
            )
            return
        table = Table(title=name, title_justify="left")
        for col in ("version", "stage", "aliases", "flavor", "run", "dataset", "test metrics", "created"):
            table.add_column(col, no_wrap=True)
        for v in versions:
            test = v.metrics.get("test", {})
            shown = ", ".join(f"{k}={fmt(x)}" for k, x in list(test.items())[:2]) or "-"
            table.add_row(
                str(v.version),
                v.stage,
                ", ".join(v.aliases) or "-",
                v.flavor,
                (v.run_id or "-")[:8],
                v.dataset_version or "-",
                shown,
                v.created_at.isoformat()[:19],
            )
        console().print(table)
        return
    mv = get_version(ref)
    if as_json:
        typer.echo(json.dumps(mv.to_json()))
        return
    con = console()
    for key in (
        "name",
        "version",
        "flavor",
        "stage",
        "run_id",
        "dataset_version",
        "code_version",
        "description",
    ):
        con.print(f"[bold]{key:>16}[/bold]  {fmt(getattr(mv, key))}")
    con.print(f"[bold]{'aliases':>16}[/bold]  {', '.join(mv.aliases) or '-'}")
    for split, metrics in mv.metrics.items():
        con.print(f"[bold]{split:>16}[/bold]  " + ", ".join(f"{k}={fmt(v)}" for k, v in metrics.items()))
    sig = mv.signature
    if sig and "inputs" not in sig:  # a language model's: text in, text out
        con.print(f"[bold]{'signature':>16}[/bold]  {sig.get('task')}")
    elif sig:
        out = sig.get("outputs", {})
        con.print(
            f"[bold]{'signature':>16}[/bold]  in {sig['inputs']['dtype']}{sig['inputs']['shape']} -> "
            f"out {out.get('dtype')}{out.get('shape')} ({sig.get('task')})"
        )
    for fname, info in sorted(mv.files.items()):
        con.print(f"[bold]{'file':>16}[/bold]  {fname}  {info['size']} B  sha256:{info['sha256'][:12]}")
    lineage = {k: v for k, v in mv.lineage.items() if k not in ("params",) and v is not None}
    con.print(f"[bold]{'lineage':>16}[/bold]  {json.dumps(lineage)}")


@models_app.command("register")
def register_cmd(
    name: str = typer.Argument(..., help="Model name."),
    run: str | None = typer.Option(None, "--run", help="Register the model stored by this finished run."),
    folder: Path | None = typer.Option(
        None, "--dir", help="Or a folder with model.safetensors|model.skops|model.onnx and config.json."
    ),
    file: Path | None = typer.Option(
        None, "--file", help="Or one .onnx/.skops file (safetensors needs --dir)."
    ),
    task: str = typer.Option("classification", "--task", help="With --file: classification or regression."),
    description: str = typer.Option("", "--description", "-d", help="Free text kept with the version."),
    team: str | None = typer.Option(
        None,
        "--team",
        help="The team a new model belongs to (default: default; a new version keeps its model's).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Register a new version from a run, a folder or a single ONNX/skops file."""
    from gpuyard.errors import ConfigError
    from gpuyard.models.registry import register_file, register_folder, register_from_run

    if sum(x is not None for x in (run, folder, file)) != 1:
        raise ConfigError("give exactly one of --run, --dir or --file")
    if run:
        mv = register_from_run(name, run, description=description, team=team)
    elif folder:
        mv = register_folder(name, folder, description=description, team=team)
    elif file is not None:
        mv = register_file(name, file, task=task, description=description, team=team)
    else:  # unreachable: exactly one source was checked above
        raise ConfigError("give exactly one of --run, --dir or --file")
    if as_json:
        typer.echo(json.dumps(mv.to_json()))
        return
    typer.echo(f"registered {mv.ref} ({mv.flavor}, stage {mv.stage})")


@models_app.command("alias")
def alias_cmd(
    ref: str = typer.Argument(..., help="NAME:VERSION to point the alias at."),
    alias: str = typer.Argument(..., help="Alias name (e.g. champion, candidate)."),
    delete: bool = typer.Option(False, "--delete", help="Remove the alias instead (REF is then NAME)."),
) -> None:
    """Set (or delete) an alias: NAME@ALIAS then resolves to that version."""
    from gpuyard.models.registry import delete_alias, set_alias
    from gpuyard.refs import ModelRef

    if delete:
        name = ModelRef.parse(ref).name
        delete_alias(name, alias)
        typer.echo(f"deleted {name}@{alias}")
        return
    mv = set_alias(ref, alias)
    typer.echo(f"{mv.name}@{alias} -> {mv.ref}")


@models_app.command("stage")
def stage_cmd(
    ref: str = typer.Argument(..., help="NAME:VERSION or NAME@ALIAS."),
    stage: str = typer.Argument(..., help="none, staging or archived (production: use promote)."),
) -> None:
    """Move a version to another stage (production is reached only by promote)."""
    from gpuyard.models.registry import set_stage

    mv = set_stage(ref, stage)
    typer.echo(f"{mv.ref} is now {mv.stage}")


@models_app.command("promote")
def promote_cmd(
    ref: str = typer.Argument(..., help="The challenger: NAME:VERSION or NAME@ALIAS."),
    metric: str | None = typer.Option(
        None, "--metric", help="Deciding metric (default: the one its run optimised)."
    ),
    direction: str | None = typer.Option(
        None, "--direction", help="maximize or minimize (default: the metric's)."
    ),
    holdout: str | None = typer.Option(
        None, "--holdout", help="Dataset to compare on (default: its test split)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Promote to production if it beats the production version on the holdout (exit 1 when refused)."""
    from gpuyard.models.promote import promote

    decision = promote(ref, metric=metric, direction=direction, holdout=holdout)
    if as_json:
        typer.echo(json.dumps(decision.to_json()))
    else:
        verdict = "promoted" if decision.promoted else "not promoted"
        typer.echo(
            f"{decision.name}:{decision.challenger} {verdict}: {decision.reason} "
            f"(holdout {decision.holdout}, {decision.n_samples} rows)"
        )
    if not decision.promoted:
        raise typer.Exit(1)


@models_app.command("optimize")
def optimize_cmd(
    ref: str = typer.Argument(..., help="A torch model: NAME:VERSION or NAME@ALIAS."),
    holdout: str | None = typer.Option(
        None, "--holdout", help="Dataset to measure on (default: its test split)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """ONNX export checked against onnxruntime, int8 dynamic quantization, torch.export: size, latency."""
    from gpuyard.models.optimize import optimize_version

    report = optimize_version(ref, holdout=holdout)
    if as_json:
        typer.echo(json.dumps(report))
        return
    metric = report["metric"]
    table = Table(
        title=f"{report['model']} on {report['holdout']} ({report['rows']} rows)", title_justify="left"
    )
    for col in ("variant", "size (KiB)", "batch 1 (ms)", "batch 64 (ms)", metric, "max |diff|"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in report["variants"]:
        size = "-" if v["size_bytes"] is None else f"{v['size_bytes'] / 1024:.1f}"
        diff = v.get("max_abs_diff_vs_torch")
        table.add_row(
            v["variant"],
            size,
            f"{v['latency_ms_batch1']:.3f}",
            f"{v['latency_ms_batch64']:.3f}",
            f"{v[metric]:.4f}",
            "-" if diff is None else f"{diff:.1e}",
        )
    console().print(table)
    typer.echo("stored with the version: model.onnx, model.int8.onnx, optimize.json")


@models_app.command("retrain")
def retrain_cmd(
    policy: Path = typer.Argument(..., help="Retraining policy YAML (model, spec, triggers)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print the decision."),
    watch: float | None = typer.Option(
        None, "--watch", help="Check again every this many seconds until Ctrl-C."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one document per pass)."),
) -> None:
    """Apply a retraining policy: new data / drift / schedule -> train -> evaluate -> register -> promote."""
    import time

    from gpuyard.models.retrain import run_policy

    while True:
        out = run_policy(policy, dry_run=dry_run)
        if as_json:
            typer.echo(json.dumps(out))
        else:
            d = out["decision"]
            typer.echo(("retrain: " + "; ".join(d["reasons"])) if d["retrain"] else "no retrain due")
            if "challenger" in out:
                p = out["promotion"]
                verdict = "promoted" if p["promoted"] else "not promoted"
                typer.echo(
                    f"run {out['run_id'][:8]} -> {out['challenger']} (staging) -> {verdict}: {p['reason']}"
                )
        if watch is None:
            return
        time.sleep(watch)  # a polling loop the user asked for, not a wait for a condition


@models_app.command("export")
def export_cmd(
    ref: str = typer.Argument(..., help="NAME, NAME:VERSION or NAME@ALIAS."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write (must be empty or new)."),
) -> None:
    """Write a version's files (weights, config, signature, optimized variants) and model.json to a folder."""
    from gpuyard.models.registry import export

    path = export(ref, out)
    for f in sorted(path.iterdir()):
        typer.echo(f"{f}  {f.stat().st_size} B")


def register(app: typer.Typer) -> None:
    """Add `gpuyard models` to the CLI."""
    app.add_typer(models_app, name="models")
