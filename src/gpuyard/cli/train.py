"""`gpuyard train SPEC.yaml`: run a training job under torchrun (restarts, rendezvous, exit codes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from gpuyard.states import TrainOutcome
from gpuyard.train.status import UNKNOWN


def train(
    spec: Path = typer.Argument(..., help="The training spec (YAML)."),
    nproc: int = typer.Option(1, "--nproc", help="Processes (ranks) on this node."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes taking part (needs --rdzv when > 1)."),
    rdzv: Optional[str] = typer.Option(
        None, "--rdzv", help="HOST:PORT of the rendezvous, same on every node."
    ),
    world_size: Optional[int] = typer.Option(
        None,
        "--world-size",
        help="Ranks of the job over all nodes, when nodes run different --nproc (default: nproc x nnodes).",
    ),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", help="Overrides spec.max_restarts."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="Overrides spec.run_dir."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="A `gpuyard plan --json` file: its dp/tp/pp."),
    tracking: Optional[str] = typer.Option(
        None, "--tracking", help="db: record the run in the state store (the default); jsonl: only the file."
    ),
    experiment: Optional[str] = typer.Option(
        None, "--experiment", "-e", help="Experiment of the tracked run (default: the spec's name)."
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Start a new run; the folder's earlier run is kept as <name>.prev-<time>."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the spec as the ranks would (build the model and data once, no training) and print "
        "the torchrun command.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON."),
) -> None:
    """Train: exit 0 done, 75 preempted (SIGTERM, checkpoint written), 76 diverged (NaN/inf loss)."""
    from gpuyard.cli.main import fast_exit
    from gpuyard.train.launch import LaunchConfig, check_components, launch, prepare, torchrun_command

    cfg = LaunchConfig(
        spec, nproc, nnodes, rdzv, max_restarts, run_dir, plan, tracking, experiment, fresh, world_size
    )
    if dry_run:
        parsed, overrides = prepare(cfg)
        check_components(cfg, parsed)
        cmd = torchrun_command(cfg, parsed, overrides)
        typer.echo(json.dumps({"command": cmd}) if as_json else " ".join(cmd))
        return
    result = launch(cfg)
    fast_exit()  # torch is loaded (the entrypoints were imported); the run is over and recorded
    doc = {"exit_code": result.exit_code, "run_dir": str(result.run_dir), **result.status}
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        typer.echo(final_line(result.status, result.exit_code), err=True)
    raise typer.Exit(result.exit_code)


def final_line(status: dict[str, Any], exit_code: int) -> str:
    """The one line `gpuyard train` ends with: how the run ended, where it can resume, what the
    launch did besides training (checkpoints set aside, restarts) and the last metrics."""
    step = status.get("step", "?")
    run_id = status.get("run_id")
    tracked = f"; run {run_id[:8]} (gpuyard runs show {run_id[:8]})" if run_id else ""
    if run_id and status.get("tracking_failed"):
        tracked = f"; run {run_id[:8]} not in the database (see the warning; metrics.jsonl has it all)"
    if status.get("already_complete"):
        return (
            f"already complete at step {step}; nothing to train ({status.get('checkpoint')}; "
            f"--fresh starts a new run){tracked}"
        )
    notes = "".join(f"; {n}" for n in status.get("notes") or [])
    if status.get("previous_run_dir"):
        notes += f"; the earlier run is kept in {status['previous_run_dir']}"
    if status.get("status") == TrainOutcome.FAILED and status.get("error"):
        log = f"; log {status['log']}" if status.get("log") and not status.get("unrecoverable") else ""
        return f"failed at step {step}: {status['error']}{notes}{log}; exit {exit_code}{tracked}"
    if status.get("status") == UNKNOWN:
        return f"outcome unknown: {status.get('error')}{notes}; exit {exit_code}{tracked}"
    where = status.get("checkpoint") or "no checkpoint"
    metrics = status.get("metrics") or {}
    shown = [f"{k} {metrics[k]:.4g}" for k in ("loss", "val_loss", "val_accuracy") if k in metrics]
    scores = f"; {', '.join(shown)}" if shown else ""
    return (
        f"{status.get('status', UNKNOWN)} at step {step} ({where}){scores}{notes}; exit {exit_code}{tracked}"
    )


def register(app: typer.Typer) -> None:
    """Add `gpuyard train` to the CLI."""
    app.command("train")(train)
