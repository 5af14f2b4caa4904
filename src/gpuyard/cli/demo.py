"""`gpuyard demo`: a tour of what gpuyard does, run for real on the embedded default."""

from __future__ import annotations

import time
from collections.abc import Callable

import typer
from rich.console import Console
from rich.rule import Rule

console = Console()


def _machine() -> None:
    from gpuyard.cli.hw import render
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.record import record_inventory

    inventory = probe_node()
    render(inventory.to_dict(), console)
    record_inventory(inventory)
    console.print("Recorded in the state store (table `nodes`), where the scheduler reads GPU health.")


def _state() -> None:
    from gpuyard.settings import load_settings
    from gpuyard.store import get_store

    settings = load_settings()
    store = get_store(settings)
    current, heads = store.revision_status()
    console.print(f"state store  {store.safe_url}  (schema {'current' if current == heads else 'behind'})")
    console.print(f"artifacts    {settings.artifact_root}")


def _fabric() -> None:
    from gpuyard.cli.plan import print_plans
    from gpuyard.fabric.cluster import load_cluster
    from gpuyard.fabric.collectives import estimate
    from gpuyard.fabric.models import load_model
    from gpuyard.fabric.planner import plan

    cluster = load_cluster("dgx-h100")
    console.print("all_reduce of 1 GiB on DGX H100 nodes (NVLink4 + NVSwitch inside, 8x NDR 400G between):")
    for gpus in (8, 64, 1024):
        est = estimate(cluster, "all_reduce", gpus, 1 << 30)
        console.print(
            f"  {gpus:>5} GPUs: {est.algorithm:<12} {est.time_s * 1e3:8.2f} ms"
            f"   busbw {est.busbw_GBps:6.1f} GB/s"
        )
    model = load_model("llama3-70b")
    t0 = time.perf_counter()
    result = plan(model, cluster, 512, 1024, top=3)
    took = time.perf_counter() - t0
    print_plans(result, f"Training {model.name} on 512 H100s, global batch 1024 (searched in {took:.2f} s)")


STEPS: list[tuple[str, Callable[[], None]]] = [
    ("This machine: accelerators, topology, health", _machine),
    ("Where gpuyard keeps its state", _state),
    ("The fabric: collective cost model and parallelism planner", _fabric),
]


def demo() -> None:
    """Run the tour: inventory, state store, fabric model and planner (each step is real work)."""
    for i, (title, step) in enumerate(STEPS, 1):
        console.print(Rule(f"[bold]{i}. {title}"))
        step()
    console.print(Rule())
    console.print("Next: `gpuyard --help` lists every command; docs/ has a page per area.")


def register(app: typer.Typer) -> None:
    """Add `gpuyard demo` to the CLI."""
    app.command("demo")(demo)
