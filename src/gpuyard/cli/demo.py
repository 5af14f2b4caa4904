"""`gpuyard demo`: the whole AI training process on scikit-learn's digits, run for real as a pipeline.

ingest -> clean/validate -> augment + normalize -> stratified split -> hyperparameter search (4 trials,
2 at a time) -> DDP training on 2 processes -> test accuracy and F1 -> register + promote -> serve ->
predictions -> drift report -> fabric cost of the same model on a DGX H100 cluster. Every figure printed
is computed by the stages; the pipeline is ``gpuyard/pipelines/demo.yaml`` (= examples/digits).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.rule import Rule

console = Console()


def demo(
    quick: bool = typer.Option(False, "--quick", help="shorter training (tests); every stage still runs"),
    executor: str = typer.Option(
        "jobs", help="jobs: a scheduler in this process; server: the running `gpuyard server` (same home)"
    ),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="run every stage even if a previous demo cached it"
    ),
) -> None:
    """Run the digits pipeline end to end (about 3-4 minutes on 2 CPU cores); each stage a scheduled job."""
    from gpuyard.cli.run import print_reports, run_with_view
    from gpuyard.pipelines.demo import demo_spec
    from gpuyard.settings import load_settings

    spec = demo_spec(quick)
    settings = load_settings()
    console.print(Rule("[bold]gpuyard demo: digits, from raw images to a monitored model"))
    console.print(
        f"state: {settings.database_url.split('?')[0]}  artifacts: {settings.artifact_root}\n"
        "Each stage below is a job of gpuyard's scheduler (recorded; `gpuyard jobs` lists them later)."
    )
    t0 = time.perf_counter()
    result = run_with_view(spec, Path.cwd(), executor, not no_cache)
    took = time.perf_counter() - t0
    console.print(Rule("[bold]What each stage did"))
    print_reports(result)
    test = result.outputs("test")["metrics"]
    reg = result.outputs("register")
    console.print(Rule())
    console.print(
        f"Done in {took:.0f} s: {reg['model']} test accuracy {test['accuracy']:.4f},"
        f" F1 (macro) {test['f1_macro']:.4f}; nothing is left running."
    )
    console.print(
        "Dashboard: run `gpuyard server`, then open http://127.0.0.1:8765/"
        " (jobs, runs, models, deployments).\n"
        "Next: `gpuyard models show digits`, `gpuyard runs ls --experiment digits`,"
        " `gpuyard data show digits`,\n"
        "      `gpuyard deploy digits@production`, `gpuyard run examples/diabetes/pipeline.yaml`,"
        " `gpuyard plan --help`.\n"
        "Run `gpuyard demo` again: unchanged stages are skipped (cached by the content hash of their inputs)."
    )


def register(app: typer.Typer) -> None:
    """Add `gpuyard demo` to the CLI."""
    app.command("demo")(demo)
