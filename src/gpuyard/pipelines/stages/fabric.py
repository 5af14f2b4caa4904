"""The fabric stage: what training the pipeline's own model would cost on a GPU cluster preset.

The parallelism planner (``gpuyard.fabric.planner``) models decoder-only transformers; the pipeline's
model is an MLP, for which the only sensible layout is data parallelism. So this stage prices a DDP
step with the fabric's pieces: compute from the parameter count (6 FLOPs per parameter per sample,
at the preset's BF16 peak times its GEMM efficiency) and the gradient all-reduce from
``gpuyard.fabric.collectives.estimate`` on the preset's NVLink and network, counted without overlap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import PlanInputs, parse_inputs


def _param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as fh:
        for key in fh.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
            # Standardisation buffers are not trained: they are not in the gradient all-reduce.
            if key.endswith(("mean", "std")):
                continue
            shape = fh.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= int(d)
            total += n
    return total


def ddp_rows(cluster: Any, params: int, global_batch: int, gpu_counts: list[int]) -> list[dict[str, Any]]:
    """Modelled DDP steps of a ``params``-parameter model on ``cluster`` for each GPU count."""
    from gpuyard.fabric.collectives import estimate

    spec = cluster.spec
    if spec is None or not spec.bf16_tflops:
        raise ConfigError(f"cluster {cluster.name}: no BF16 peak for {cluster.accelerator}")
    flops_s = spec.bf16_tflops * 1e12 * cluster.compute.gemm_efficiency
    rows = []
    for gpus in gpu_counts:
        compute = 6 * params * (global_batch / gpus) / flops_s
        comm = estimate(cluster, "all_reduce", gpus, 4 * params)  # fp32 gradients
        step = compute + comm.time_s
        rows.append(
            {
                "gpus": gpus,
                "nodes": -(-gpus // cluster.gpus_per_node),
                "compute_ms": compute * 1e3,
                "allreduce_ms": comm.time_s * 1e3,
                "algorithm": comm.algorithm,
                "step_ms": step * 1e3,
                "samples_per_s": global_batch / step,
                "comm_share": comm.time_s / step,
            }
        )
    return rows


def plan_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Price data-parallel training of the model in ``model_dir`` on ``cluster`` (default dgx-h100)."""
    from gpuyard.fabric.presets import load_cluster

    i = parse_inputs(PlanInputs, inputs, ctx["stage"])
    cluster = load_cluster(i.cluster)
    params = _param_count(Path(i.model_dir))
    batch = i.global_batch
    rows = ddp_rows(cluster, params, batch, list(i.gpu_counts))
    best = max(rows, key=lambda r: r["samples_per_s"])
    lines = [
        f"{cluster.name}: {cluster.accelerator}, {cluster.gpus_per_node} per node;"
        f" model of {params:,} parameters, global batch {batch}, data parallel"
        " (the planner's other layouts split transformer layers, which this MLP does not have)",
        f"{'GPUs':>6} {'nodes':>5} {'compute ms':>11} {'all-reduce ms':>14} {'algorithm':>10}"
        f" {'step ms':>9} {'samples/s':>13} {'comm':>5}",
    ]
    for r in rows:
        lines.append(
            f"{r['gpus']:>6} {r['nodes']:>5} {r['compute_ms']:>11.4f} {r['allreduce_ms']:>14.4f}"
            f" {r['algorithm']:>10} {r['step_ms']:>9.4f} {r['samples_per_s']:>13,.0f} {r['comm_share']:>5.0%}"
        )
    lines.append(
        f"compute at {cluster.compute.gemm_efficiency:.0%} of the BF16 peak, which layers this narrow never"
        " reach (kernel launches dominate): the compute column is a lower bound"
    )
    lines.append(
        f"fastest: {best['gpus']} GPUs; past it the gradient all-reduce costs more than the compute it saves"
        if best is not rows[-1]
        else f"fastest: {best['gpus']} GPUs (compute still dominates)"
    )
    return {
        "cluster": cluster.name,
        "params": params,
        "rows": rows,
        "best_gpus": best["gpus"],
        "report": lines,
    }
