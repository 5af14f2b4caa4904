"""`gpuyard plan`: search parallel layouts for training a transformer on a cluster."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

from gpuyard.fabric.stacks import STACKS


def plan_command(
    model: str = typer.Option(
        ...,
        "--model",
        help="Preset (gpt3-175b, llama3-8b/70b/405b, ...), a YAML/JSON model file, or a Hugging Face"
        " config.json (or its folder).",
    ),
    cluster: str = typer.Option(
        ..., "--cluster", help="Cluster preset or file (see `gpuyard fabric clusters`)."
    ),
    gpus: int = typer.Option(..., "--gpus", help="GPUs to train on."),
    global_batch: int = typer.Option(..., "--global-batch", help="Sequences per optimizer step."),
    seq_len: int = typer.Option(None, "--seq-len", help="Tokens per sequence (default: the model's)."),
    tp: int = typer.Option(None, "--tp", help="Hold tensor-parallel size."),
    pp: int = typer.Option(None, "--pp", help="Hold pipeline-parallel size."),
    cp: int = typer.Option(None, "--cp", help="Hold context-parallel size."),
    micro_batch: int = typer.Option(None, "--micro-batch", help="Hold the micro-batch size."),
    virtual_stages: int = typer.Option(None, "--virtual-stages", help="Hold interleaved stages per GPU."),
    recompute: str = typer.Option(None, "--recompute", help="Hold recomputation: none, selective or full."),
    sequence_parallel: bool = typer.Option(
        None, "--sequence-parallel/--no-sequence-parallel", help="Hold sequence parallelism on or off."
    ),
    zero: int = typer.Option(None, "--zero", help="Hold the ZeRO stage (0-3; 3 = FSDP)."),
    ep: int = typer.Option(None, "--ep", help="Hold expert-parallel size (mixture-of-experts models)."),
    precision: str = typer.Option("bf16", "--precision", help="Training precision: bf16, fp16, fp8 or fp32."),
    stack: str = typer.Option(
        "megatron-lm",
        "--stack",
        help=f"Software stack: {', '.join(STACKS)} "
        "(optimizer, fused kernels, attention family; docs/fabric.md).",
    ),
    calibration: Path = typer.Option(
        None, "--calibration", help="A `gpuyard fabric calibrate` file measured on this cluster's devices."
    ),
    checkpoint_s: float = typer.Option(
        None,
        "--checkpoint-s",
        min=0,
        help="Training stall per checkpoint, seconds (default: the state at 2 GB/s per node).",
    ),
    restart_s: float = typer.Option(
        600.0, "--restart-s", min=0, help="Failure to training again, seconds (for the expected ETTR)."
    ),
    compare: str = typer.Option(
        None,
        "--compare",
        help="A second cluster (e.g. a TPU slice: tpu-v5p-512) planned for the same model and batch.",
    ),
    compare_gpus: int = typer.Option(
        None, "--compare-gpus", help="Accelerators to use on --compare (default: --gpus)."
    ),
    compare_stack: str = typer.Option(
        None, "--compare-stack", help="Software stack on --compare (default: maxtext on a TPU, else --stack)."
    ),
    storage: str = typer.Option(
        None,
        "--storage",
        help="A storage tier (meta-tectonic, superpod-gds, s3-c5n, or a YAML/JSON file): whether loading "
        "and checkpoint writes stall the GPUs on it; its checkpoint write time becomes the stall.",
    ),
    checkpoint_interval_min: float = typer.Option(
        None,
        "--checkpoint-interval-min",
        min=0.001,
        help="Checkpoint interval for the storage check, minutes (default: the best-ETTR interval).",
    ),
    bytes_per_sample: int = typer.Option(
        None,
        "--bytes-per-sample",
        min=1,
        help="Bytes the loader reads per sequence (default: the stored token IDs, 2 or 4 per token).",
    ),
    top: int = typer.Option(5, "--top", help="Plans to show."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Plan tp x pp x dp x cp and memory knobs for a model; plans that do not fit are dropped."""
    from gpuyard.fabric.calibrate import load_calibrated
    from gpuyard.fabric.hf_config import load_any_model as load_model
    from gpuyard.fabric.planner import Knobs, expected_ettr, plan
    from gpuyard.fabric.presets import load_cluster

    knobs = Knobs(
        tp=tp,
        pp=pp,
        cp=cp,
        micro_batch=micro_batch,
        virtual_stages=virtual_stages,
        recompute=recompute,
        zero=zero,
        sequence_parallel=sequence_parallel,
        ep=ep,
        precision=precision,
        stack=stack,
    )
    from gpuyard.fabric.storage import check_storage, checkpoint_write_s, load_tier

    spec, fabric = load_model(model), load_calibrated(load_cluster(cluster), calibration)
    tier = load_tier(storage) if storage is not None else None
    result = plan(spec, fabric, gpus, global_batch, seq_len, knobs, top)
    if tier is not None and checkpoint_s is None:
        checkpoint_s = checkpoint_write_s(tier, spec, gpus, fabric.gpus_per_node)
    goodput = expected_ettr(spec, fabric, gpus, checkpoint_s, restart_s)
    storage_check = None
    if tier is not None and result.plans:
        if checkpoint_interval_min is not None:
            interval = checkpoint_interval_min * 60
        elif math.isfinite(goodput.best_interval_s) and goodput.best_interval_s > 0:
            interval = goodput.best_interval_s
        else:
            interval = 3600.0  # nothing fails in the model, or free checkpoints: an hour, said in the line
        storage_check = check_storage(
            tier,
            spec,
            result.plans[0].tokens_per_s,
            gpus,
            fabric.gpus_per_node,
            interval,
            seq_len or spec.seq_len,
            bytes_per_sample,
        )
    other = None
    if compare is not None:
        other_fabric = load_cluster(compare)
        other_gpus = compare_gpus or gpus
        other_stack = compare_stack or ("maxtext" if other_fabric.torus is not None else stack)
        # Only the precision and the stack carry over: a layout chosen for one machine means nothing on
        # the other, so the second search is free.
        other_knobs = Knobs(precision=precision, stack=other_stack)
        other = (
            other_fabric,
            other_gpus,
            plan(spec, other_fabric, other_gpus, global_batch, seq_len, other_knobs, top),
        )
    if as_json:
        doc = {
            "model": spec.name,
            "cluster": fabric.name,
            "gpus": gpus,
            "global_batch": global_batch,
            "seq_len": seq_len or spec.seq_len,
            "considered": result.considered,
            "fitting": result.fitting,
            "plans": [p.to_dict() for p in result.plans],
            "warnings": result.warnings,
            "ettr": goodput.to_dict(),
        }
        if storage_check is not None:
            doc["storage"] = storage_check.to_dict()
        if other is not None:
            o_fabric, o_gpus, o_result = other
            doc["compare"] = {
                "cluster": o_fabric.name,
                "gpus": o_gpus,
                "considered": o_result.considered,
                "fitting": o_result.fitting,
                "plans": [p.to_dict() for p in o_result.plans],
                "warnings": o_result.warnings,
                "speedup": o_result.plans[0].tokens_per_s / result.plans[0].tokens_per_s,
            }
        typer.echo(json.dumps(doc))
        return
    print_plans(result, f"{spec.name} on {gpus} x {fabric.device_name} ({fabric.name}), batch {global_batch}")
    print_ettr(goodput)
    if storage_check is not None:
        for line in storage_check.lines():
            typer.echo(line)
    if other is not None:
        o_fabric, o_gpus, o_result = other
        title = f"{spec.name} on {o_gpus} x {o_fabric.device_name} ({o_fabric.name}), batch {global_batch}"
        print_plans(o_result, title)
        print_comparison(
            result, f"{gpus} x {fabric.device_name}", o_result, f"{o_gpus} x {o_fabric.device_name}"
        )


def print_comparison(first: object, first_name: str, second: object, second_name: str) -> None:
    """One line per machine (best plan's step, tokens/s, per accelerator, MFU), then the ratio."""
    from gpuyard.fabric.planner import PlanResult

    assert isinstance(first, PlanResult) and isinstance(second, PlanResult)
    a, b = first.plans[0], second.plans[0]
    for name, p in ((first_name, a), (second_name, b)):
        per = p.tokens_per_s / p.config.gpus
        typer.echo(
            f"{name}: step {p.step_time_s:.2f} s, {p.tokens_per_s:,.0f} tokens/s "
            f"({per:,.0f} per accelerator), MFU {p.mfu:.1%}"
        )
    typer.echo(f"{second_name} trains {b.tokens_per_s / a.tokens_per_s:.2f}x as fast as {first_name}")


def print_ettr(goodput: object) -> None:
    """The expected ETTR at the planned scale: one line, then ETTR per checkpoint interval."""
    from gpuyard.fabric.failures import EttrPlan

    assert isinstance(goodput, EttrPlan)
    cells = "  ".join(f"{t / 60:g} min: {e:.1%}" for t, e in goodput.by_interval)
    typer.echo(goodput.summary())
    typer.echo(f"ETTR by checkpoint interval: {cells}")
    typer.echo(f"failure model: {goodput.model.name}; {goodput.model.source}")
    for note in goodput.notes:
        typer.echo(note)


def print_plans(result: object, title: str) -> None:
    """Print ranked plans as a table, with why the first one wins."""
    from rich.console import Console
    from rich.table import Table

    from gpuyard.fabric.planner import PlanResult

    assert isinstance(result, PlanResult)  # narrowing for mypy; plan() always returns one
    table = Table(title=title)
    for col in (
        "#",
        "tp.pp.dp.cp",
        "ep",
        "mb",
        "vp",
        "recomp",
        "zero",
        "sp",
        "step s",
        "tokens/s",
        "MFU",
        "GiB/GPU",
        "bubble s",
        "comm s",
    ):
        table.add_column(col, justify="right")
    for i, p in enumerate(result.plans, 1):
        c, b = p.config, p.breakdown
        table.add_row(
            str(i),
            f"{c.tp}.{c.pp}.{c.dp}.{c.cp}",
            str(c.ep),
            str(c.micro_batch),
            str(c.virtual_stages),
            c.recompute,
            str(c.zero),
            "yes" if c.sequence_parallel else "no",
            f"{p.step_time_s:.2f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.1%}",
            f"{p.memory_gib_per_gpu:.1f}",
            f"{b.bubble_s:.2f}",
            f"{b.exposed_comm_s:.2f}",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    console.print(f"{result.fitting} of {result.considered} layouts fit in memory. {result.explain()}")
    for warning in result.warnings:
        console.print(f"warning: {warning}", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    """Add `gpuyard plan` to the root command."""
    app.command("plan")(plan_command)
