"""`gpuyard run PIPELINE.yaml`: run a pipeline's stages as scheduled jobs with a live progress view."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

console = Console()


class _View:
    """The live table: one row per stage with its state, job, time and latest log line."""

    def __init__(self, stages: list[Any]) -> None:
        self.rows = {
            st.name: {"uses": st.uses, "state": "waiting", "job": "", "t0": 0.0, "secs": None, "log": ""}
            for st in stages
        }

    def event(self, e: dict[str, Any]) -> None:
        row = self.rows[e["stage"]]
        kind = e["type"]
        if kind == "start":
            row.update(state="running", t0=time.perf_counter())
        elif kind == "job":
            row["job"] = str(e["job_id"])
        elif kind == "log":
            row["log"] = e["line"].strip()[-70:]
        elif kind == "done":
            row.update(state="cached" if e["cached"] else "done", secs=e["seconds"], log="")
            if e.get("job_id") and not row["job"]:
                row["job"] = f"({e['job_id']})" if e["cached"] else str(e["job_id"])
        elif kind == "failed":
            row.update(state="failed", log=e["error"].splitlines()[0][:70])

    def table(self) -> Table:
        t = Table(show_edge=False)
        # The last line a running stage printed; once no row has one (all done), the column goes.
        with_log = any(r["log"] or r["state"] == "running" for r in self.rows.values())
        for col in ("stage", "uses", "state", "job", "time", "latest output")[: 6 if with_log else 5]:
            t.add_column(col, no_wrap=col != "latest output")
        colour = {"done": "green", "cached": "cyan", "running": "yellow", "failed": "red", "waiting": "dim"}
        for name, r in self.rows.items():
            secs = (
                r["secs"] if r["secs"] is not None else (time.perf_counter() - r["t0"] if r["t0"] else None)
            )
            shown = "" if secs is None else f"{secs:.1f}s"
            state = f"[{colour[r['state']]}]{r['state']}[/]"
            t.add_row(name, r["uses"], state, r["job"], shown, *([r["log"]] if with_log else []))
        return t


def run_with_view(spec: Any, base: Path, executor: str = "jobs", use_cache: bool = True) -> Any:
    """Run ``spec`` with the live table, then print each stage's report; returns the PipelineResult."""
    from gpuyard.pipelines.runner import run_pipeline

    view = _View(spec.stages)
    with Live(view.table(), console=console, refresh_per_second=4, transient=False) as live:

        def on_event(e: dict[str, Any]) -> None:
            view.event(e)
            live.update(view.table())

        try:
            result = run_pipeline(spec, base, executor=executor, use_cache=use_cache, on_event=on_event)
        finally:
            live.update(view.table())
    console.print()
    return result


def print_reports(result: Any) -> None:
    """Each stage's report lines under its name."""
    for st in result.stages:
        tag = (
            f" (cached: inputs unchanged since job {st.job_id})"
            if st.cached
            else f" ({st.seconds:.1f} s, job {st.job_id})"
            if st.job_id
            else f" ({st.seconds:.1f} s)"
        )
        console.print(f"[bold]{escape(st.name)}[/] [dim]{escape(st.uses)}{tag}[/]")
        for line in st.outputs.get("report", []):
            console.print(f"  {line}", markup=False, highlight=False)


def run(
    pipeline: Path = typer.Argument(..., help="the pipeline YAML"),
    executor: str = typer.Option(
        "jobs",
        help="jobs: each stage a job of a scheduler in this process; server: of the running"
        " `gpuyard server`; inline: in this process",
    ),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="run every stage even if its inputs are unchanged"
    ),
    json_out: bool = typer.Option(False, "--json", help="print the stages' outputs as one JSON document"),
) -> None:
    """Run a pipeline: stages in order, each a job; unchanged stages are skipped (content-hash cache)."""
    import json

    from gpuyard.pipelines.runner import run_pipeline
    from gpuyard.pipelines.spec import load_pipeline

    spec = load_pipeline(pipeline)
    base = pipeline.resolve().parent
    if json_out:
        result = run_pipeline(spec, base, executor=executor, use_cache=not no_cache)
        doc = [
            {
                "stage": s.name,
                "uses": s.uses,
                "cached": s.cached,
                "seconds": s.seconds,
                "job_id": s.job_id,
                "outputs": s.outputs,
            }
            for s in result.stages
        ]
        out = {"pipeline": spec.name, "stages": doc, "summary": result.summary}
        typer.echo(json.dumps(out, default=str))
        return
    result = run_with_view(spec, base, executor, not no_cache)
    print_reports(result)
    for line in result.summary:
        console.print(line, markup=False, highlight=False)
    ran = sum(not s.cached for s in result.stages)
    skipped = len(result.stages) - ran
    console.print(f"pipeline {escape(spec.name)}: {ran} stage(s) ran, {skipped} skipped (unchanged)")


def register(app: typer.Typer) -> None:
    """Add `gpuyard run` to the CLI."""
    app.command("run")(run)
