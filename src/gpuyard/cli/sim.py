"""`gpuyard sim`: replay a job trace on a virtual cluster under one scheduling policy."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from gpuyard.scheduler.policies import POLICIES

_POLICY_HELP = "Scheduling policy: " + "; ".join(f"{name} ({cls.summary})" for name, cls in POLICIES.items())


def sim(
    trace: Path = typer.Option(..., "--trace", help="Trace CSV (generic or Philly)."),
    nodes: int = typer.Option(..., "--nodes", min=1, help="Nodes of the virtual cluster."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, help="GPUs per node."),
    policy: str = typer.Option("fifo", "--policy", help=_POLICY_HELP),
    nodes_per_leaf: int = typer.Option(
        None, "--nodes-per-leaf", min=1, help="Nodes under one leaf switch (default 16, or the preset's)."
    ),
    nodes_per_domain: int = typer.Option(1, "--nodes-per-domain", min=1, help="Nodes per NVLink domain."),
    team_weight: list[str] = typer.Option([], "--team-weight", help="TEAM=WEIGHT quota for the fair policy."),
    cluster: str = typer.Option(
        None,
        "--cluster",
        help="Fabric preset or file (gpuyard.fabric): GPUs per node, NVLink domain, leaf size.",
    ),
    oversubscription: float = typer.Option(
        None, "--oversubscription", min=1.0, help="Leaf-to-spine oversubscription (with --cluster)."
    ),
    placement: str = typer.Option(
        None,
        "--placement",
        help="With --cluster: topology (heuristics) or fabric (predicted step time decides). Either way jobs "
        "get a seeded workload by GPU count and run slower where the fabric model predicts it.",
    ),
    calibration: Path = typer.Option(
        None, "--calibration", help="With --cluster: a `gpuyard fabric calibrate` file of its devices."
    ),
    max_wait: float = typer.Option(600.0, "--max-wait", min=0.0, help="Fabric placement: longest wait (s)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload assignment."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Replay a trace through the scheduler's policy and placement code; print JCT, queueing, utilization."""
    from gpuyard.errors import ConfigError
    from gpuyard.scheduler.placement import uniform_cluster
    from gpuyard.scheduler.policies import make_policy
    from gpuyard.scheduler.simulator import simulate
    from gpuyard.scheduler.spec import parse_team_weights
    from gpuyard.scheduler.trace import load_trace

    if placement is not None and placement not in ("topology", "fabric"):
        raise ConfigError(f"--placement {placement!r}: choose topology or fabric")
    if placement and not cluster:
        raise ConfigError("--placement needs --cluster (the fabric model of the nodes)")
    if calibration and not cluster:
        raise ConfigError("--calibration needs --cluster (the cluster the calibration applies to)")
    jobs = load_trace(trace)
    fabric, workloads, placer = None, None, None
    if cluster:
        from gpuyard.fabric.calibrate import load_calibrated
        from gpuyard.fabric.presets import load_cluster
        from gpuyard.scheduler.nodes import nodes_from_fabric, with_network

        base = load_calibrated(load_cluster(cluster), calibration)
        fabric = with_network(base, nodes_per_leaf, oversubscription)
        node_list = nodes_from_fabric(fabric, nodes)
        if placement:
            from gpuyard.scheduler.fabric_placement import FabricPlacer
            from gpuyard.scheduler.workloads import trace_workloads

            workloads = trace_workloads(jobs, seed)
            placer = FabricPlacer(fabric, max_wait) if placement == "fabric" else None
    else:
        node_list = uniform_cluster(
            nodes, gpus_per_node, nodes_per_leaf=nodes_per_leaf or 16, nodes_per_domain=nodes_per_domain
        )
    chosen = make_policy(policy, weights=parse_team_weights(team_weight), placer=placer)
    result = simulate(jobs, node_list, chosen, workloads=workloads, fabric=fabric)
    doc = result.to_dict()
    if placement:
        doc["placement"] = placement
    if as_json:
        typer.echo(json.dumps(doc))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{policy}[/bold] on {len(node_list)}x{node_list[0].gpus} GPUs: {result.jobs} jobs"
        f" ({result.rejected} larger than the cluster), {result.preemptions} preemptions"
    )
    for key in ("avg_jct_s", "median_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s"):
        console.print(f"  {key:>14}  {doc[key]:,.0f}")
    console.print(f"  {'utilization':>14}  {result.utilization:.1%}")
    console.print(f"  {'fairness_jain':>14}  {result.fairness_jain:.3f}  (per-team bounded slowdown)")
    if placement:
        console.print(
            f"  placement {placement}: {result.multi_node_jobs} jobs on several nodes,"
            f" {result.multi_leaf_jobs} across leaves, {result.slowed_jobs} slower than consolidated,"
            f" {result.fabric_waits} waited for consolidation"
        )
    table = Table("team", "jobs", "avg JCT s", "avg queue s", "GPU hours")
    for team, t in result.teams.items():
        table.add_row(
            team,
            str(t["jobs"]),
            f"{t['avg_jct_s']:,.0f}",
            f"{t['avg_queue_s']:,.0f}",
            f"{t['gpu_hours']:,.0f}",
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add `gpuyard sim` to the CLI."""
    app.command("sim")(sim)
