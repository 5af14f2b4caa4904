"""`gpuyard sim`: replay a job trace on a virtual cluster under one scheduling policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from gpuyard.scheduler.openb import GpuNode, GpuTask
from gpuyard.scheduler.packing import PACKING_POLICIES
from gpuyard.scheduler.policies import POLICIES

_PACKING_HELP = "openb: GPU-sharing placement(s), comma-separated: " + "; ".join(
    f"{name} ({summary})" for name, summary in PACKING_POLICIES.items()
)
_POLICY_HELP = "Scheduling policy: " + "; ".join(f"{name} ({cls.summary})" for name, cls in POLICIES.items())


def sim(
    trace: Path = typer.Option(..., "--trace", help="Trace CSV (generic, Philly, or an openb pod list)."),
    nodes: int = typer.Option(
        None,
        "--nodes",
        min=1,
        help="Nodes of the virtual cluster (not with an openb trace: see --node-list).",
    ),
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
    seed: int = typer.Option(0, "--seed", help="Seed of the workload assignment (openb: of the arrivals)."),
    failures: str = typer.Option(
        "none",
        "--failures",
        help="Inject failures into running jobs: none, or llama3-405b (per-GPU and per-node rates of"
        " Llama 3 405B's run; docs/scheduler.md). A failed job loses the work since its checkpoint.",
    ),
    checkpoint_interval: float = typer.Option(
        600.0, "--checkpoint-interval", min=1.0, help="Seconds between the jobs' checkpoints."
    ),
    restart_s: float = typer.Option(
        60.0, "--restart-s", min=0.0, help="Seconds a preempted or failed job takes to restart."
    ),
    checkpoint_s: float = typer.Option(
        0.0, "--checkpoint-s", min=0.0, help="Seconds each checkpoint stalls a job's training."
    ),
    elastic_share: float = typer.Option(
        0.0,
        "--elastic-share",
        min=0.0,
        max=1.0,
        help="Share of the jobs (drawn with --seed) that are elastic: between half and twice the GPUs"
        " they asked for, grown into idle GPUs and shrunk to let queued jobs start.",
    ),
    elastic_alpha: float = typer.Option(
        0.8,
        "--elastic-alpha",
        min=0.0,
        max=1.0,
        help="An elastic job's speed on g GPUs instead of g0: (g/g0)^alpha (1: linear scaling).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    openb_nodes: Path = typer.Option(
        None,
        "--node-list",
        help="openb node list (default: openb_node_list_gpu_node.csv beside the openb trace); with a generic"
        " trace, its nodes instead of --nodes. A mig column gives each node's MIG layout (as --mig).",
    ),
    packing: str = typer.Option(
        "fgd,bestfit",
        "--packing",
        help=_PACKING_HELP,
    ),
    mode: str = typer.Option(
        None,
        "--mode",
        help="GPU shares: fill (tasks sampled from the trace arrive until --ratio x the GPUs, none "
        "leaves: unallocated GPUs as the cluster fills; openb's default) or replay (submit times x "
        "--time-scale, trace durations: JCT; the default for a generic trace with shares).",
    ),
    ratio: float = typer.Option(
        1.3, "--ratio", min=0.01, help="openb fill: arrived GPU requests / GPUs at the end."
    ),
    time_scale: float = typer.Option(
        1.0, "--time-scale", min=1e-9, help="openb replay: factor on creation times (< 1: arrivals faster)."
    ),
    mig: str = typer.Option(
        None,
        "--mig",
        help="MIG layout of every node's GPUs (generic trace, --nodes): GPU layouts separated by |, GPU 0"
        " first, the rest whole; N*LAYOUT for N GPUs alike, *LAYOUT for all left; a GPU's instances"
        " joined by +, e.g. '4*3g.40gb+2g.20gb+2x1g.10gb' (docs/scheduler.md). A node list takes a"
        " mig column instead.",
    ),
    mig_model: str = typer.Option(
        "H100-80GB", "--mig-model", help="With --mig: the GPU model (A100-40GB, A100-80GB, H100-80GB)."
    ),
) -> None:
    """Replay a trace through the scheduler's policy and placement code; print JCT, queueing, utilization.

    With an openb pod list (Alibaba's GPU-sharing trace, told by its header), place shares of GPUs and
    multi-GPU tasks on the openb node list under each --packing policy instead.
    """
    from gpuyard.errors import ConfigError
    from gpuyard.scheduler.openb import NODE_LIST, is_openb_pods, load_openb_nodes, load_openb_tasks
    from gpuyard.scheduler.trace import has_gpu_shares, load_share_trace
    from gpuyard.textfiles import sniff_text

    for path in (trace, openb_nodes):
        if path is not None and path.is_file():
            sniff_text(path, "trace CSV")  # a binary file is said so, not a UnicodeDecodeError
    if mig is not None and openb_nodes is not None:
        raise ConfigError("--mig is for --nodes; with --node-list give each node's layout in its mig column")
    if trace.is_file() and is_openb_pods(trace):
        if mig is not None:
            raise ConfigError(
                "--mig is for --nodes; give each node's MIG layout in the node list's mig column"
            )
        node_file = openb_nodes or trace.parent / NODE_LIST
        openb = load_openb_nodes(node_file)
        gpus = sum(n.gpus for n in openb)
        head = f"{trace.name} on {len(openb)} nodes ({gpus} GPUs, {node_file.name})"
        _sim_shares(
            head, openb, load_openb_tasks(trace), packing, mode or "fill", ratio, time_scale, seed, as_json
        )
        return
    if nodes is None and openb_nodes is None:
        raise ConfigError("--nodes is needed with a generic or Philly trace")
    # Jobs asking for part of a GPU or MIG slices, or GPUs in MIG mode: placed GPU by GPU, as openb's.
    if has_gpu_shares(trace) or mig is not None or openb_nodes is not None:
        if policy != "fifo" or cluster or placement:
            raise ConfigError(
                "a trace with GPU shares or MIG is replayed in arrival order, waiting jobs starting as they"
                " fit; --packing chooses where (--policy, --cluster and --placement are for whole-GPU"
                " traces)"
            )
        if openb_nodes is not None:
            node_list = load_openb_nodes(openb_nodes)
            head = f"{trace.name} on {len(node_list)} nodes ({sum(n.gpus for n in node_list)} GPUs,"
            head += f" {openb_nodes.name})"
        else:
            node_list = _uniform_nodes(nodes, gpus_per_node, mig, mig_model)
            head = f"{trace.name} on {nodes}x{gpus_per_node} GPUs"
        tasks = load_share_trace(trace)
        _sim_shares(head, node_list, tasks, packing, mode or "replay", ratio, time_scale, seed, as_json)
        return
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
    from gpuyard.scheduler.simulator import SimConfig

    config = SimConfig(
        checkpoint_interval_s=checkpoint_interval,
        restart_overhead_s=restart_s,
        failures=_failure_model(failures),
        failure_seed=seed,
        gpus_per_node=gpus_per_node,
        checkpoint_stall_s=checkpoint_s,
        elastic_alpha=elastic_alpha,
    )
    elastic = _elastic_jobs(jobs, elastic_share, seed)
    result = simulate(
        jobs, node_list, chosen, config=config, workloads=workloads, fabric=fabric, elastic=elastic
    )
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
    if elastic:
        console.print(f"  {'elastic':>14}  {result.elastic_jobs} jobs, {result.resizes} resizes")
    if config.failures is not None or result.preemptions:
        console.print(
            f"  {'ettr':>14}  {result.ettr:.1%}  ({result.failures} failures injected, "
            f"{result.lost_gpu_hours:,.0f} GPU hours lost; checkpoint every {checkpoint_interval:g} s)"
        )
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


def _uniform_nodes(nodes: int, gpus: int, mig: str | None, model: str) -> list[GpuNode]:
    """``nodes`` alike nodes of ``gpus`` GPUs without CPU or memory limits, in MIG mode as ``mig`` lays
    them out (of ``model``; without ``mig`` the GPUs have no model)."""
    from gpuyard.errors import ConfigError
    from gpuyard.hardware.mig import MIG_GPUS
    from gpuyard.scheduler.openb import parse_mig_layout

    if mig is None:
        return [GpuNode(f"node-{i}", 10**9, 10**12, gpus, "") for i in range(nodes)]
    if model not in MIG_GPUS:
        raise ConfigError(f"--mig-model {model!r}: choose one of {', '.join(MIG_GPUS)}")
    layout = parse_mig_layout(mig, model, gpus, "--mig")
    if not layout:
        raise ConfigError(f"--mig {mig!r} puts no GPU in MIG mode")
    return [GpuNode(f"node-{i}", 10**9, 10**12, gpus, model, layout) for i in range(nodes)]


def _mig_refusals(cluster: Any, tasks: list[GpuTask]) -> list[tuple[str, int]]:
    """Why tasks could never start (one line per cause, with how many), on a cluster or trace with
    MIG: tasks asking for MIG slices and no GPU in MIG mode are refused outright.

    Raises:
        ConfigError: the trace asks for MIG slices and no GPU here is in MIG mode.
    """
    from collections import Counter

    from gpuyard.errors import ConfigError

    mig = Counter(t.mig for t in tasks if t.mig)
    if mig and not cluster.has_mig:
        asked = ", ".join(f"{p} x{n}" for p, n in sorted(mig.items()))
        raise ConfigError(
            f"the trace asks for MIG slices ({asked}) and no GPU here is in MIG mode: give --mig LAYOUT"
            " (with --nodes) or a mig column in the node list"
        )
    if not mig and not cluster.has_mig:
        return []
    why = Counter(r for r in (cluster.never_fits(t) for t in tasks) if r is not None)
    return sorted(why.items(), key=lambda x: -x[1])


def _sim_shares(
    head: str,
    nodes: list[GpuNode],
    tasks: list[GpuTask],
    packing: str,
    mode: str,
    ratio: float,
    time_scale: float,
    seed: int,
    as_json: bool,
) -> None:
    """`gpuyard sim` with GPU shares: the fill experiment or the JCT replay, per packing policy."""
    from gpuyard.errors import ConfigError
    from gpuyard.scheduler.fragmentation import TaskMix
    from gpuyard.scheduler.gpushares import SharedCluster
    from gpuyard.scheduler.packing import make_packing
    from gpuyard.scheduler.packing_replay import fill, inflate, replay

    if mode not in ("fill", "replay"):
        raise ConfigError(f"--mode {mode!r}: choose fill or replay")
    names = [p.strip() for p in packing.split(",") if p.strip()]
    for name in names:
        if name not in PACKING_POLICIES:
            raise ConfigError(f"--packing {name!r}: choose from {', '.join(PACKING_POLICIES)}")
    if not names:
        raise ConfigError("--packing: name at least one policy")
    probe = SharedCluster(nodes)
    refusals = _mig_refusals(probe, tasks)
    mix: TaskMix | None = None
    if any(t.num_gpu and not t.mig for t in tasks) or not any(t.mig for t in tasks):
        mix = TaskMix.of(tasks)
    elif any(n in ("fgd", "fgd-exact", "fgd-bf") for n in names):
        raise ConfigError(
            "--packing: fgd, fgd-exact and fgd-bf measure the room left for GPU shares and whole GPUs,"
            " and every GPU task of this trace asks for MIG slices: choose among fgd-online, bestfit,"
            " firstfit, randomfit, dotprod"
        )
    capacity = sum(n.gpus for n in nodes)
    head = f"{head}: {len(tasks)} tasks"
    if probe.has_mig:
        head += f"; {int(probe.mig_gpus.sum())} GPUs in MIG mode, {probe.slice_node.size} slices"
        have = ", ".join(f"{p} x{int(probe.mig_total[:, k].sum())}" for k, p in enumerate(probe.mig_profiles))
        head += f" ({have})"
    refused = [f"refused {n} task{'s' if n > 1 else ''}: {why}" for why, n in refusals]
    if mode == "fill":
        arrivals = inflate(tasks, capacity, ratio, seed)
        points = sorted({round(0.1 * i, 2) for i in range(1, int(ratio * 10) + 1)} | {1.0, ratio})
        results = [
            fill(SharedCluster(nodes), arrivals, make_packing(n, mix, seed), points, mix) for n in names
        ]
        if as_json:
            doc: dict[str, Any] = {"trace": head, "mode": mode, "gpus": capacity, "arrivals": len(arrivals)}
            if refused:
                doc["refused"] = refused
            typer.echo(json.dumps({**doc, "results": [r.to_dict() for r in results]}))
            return
        typer.echo(f"{head}; {len(arrivals)} arrivals to {ratio:.0%} of the GPUs (seed {seed})")
        typer.echo("unallocated GPU % as arrived GPU requests reach each share of the cluster's GPUs:")
        typer.echo(f"{'arrived':>8} " + " ".join(f"{r.policy:>9}" for r in results))
        for i, point in enumerate(results[0].points):
            typer.echo(f"{point:8.0%} " + " ".join(f"{100 * r.unallocated[i]:9.2f}" for r in results))
        for r in results:
            frag = r.fragmentation[r.points.index(1.0)]
            typer.echo(
                f"{r.policy}: {r.placed} placed, {r.failed} fit nowhere ({r.failed_gpu:.1f} GPUs asked);"
                f" at 100%: {r.at(1.0):.2%} unallocated, expected fragmentation {frag:.2%}"
            )
            if r.mig_unallocated:
                typer.echo(
                    f"{r.policy}: MIG tasks {r.mig_placed} placed, {r.mig_failed} fit nowhere; at 100%:"
                    f" {r.mig_unallocated[r.points.index(1.0)]:.2%} of the MIG GPUs' compute unallocated"
                )
        for line in refused:
            typer.echo(line)
        return
    replays = [replay(SharedCluster(nodes), tasks, make_packing(n, mix, seed), time_scale) for n in names]
    if as_json:
        doc = {"trace": head, "mode": mode, "gpus": capacity, "time_scale": time_scale}
        if refused:
            doc["refused"] = refused
        typer.echo(json.dumps({**doc, "results": [r.to_dict() for r in replays]}))
        return
    typer.echo(f"{head}; creation times x {time_scale:g}")
    typer.echo(
        f"{'packing':>9} {'avg JCT s':>10} {'median s':>9} {'avg wait s':>10} {'waited':>7} {'rejected':>8}"
    )
    for rr in replays:
        typer.echo(
            f"{rr.policy:>9} {rr.avg_jct_s:10.0f} {rr.median_jct_s:9.0f} {rr.avg_wait_s:10.1f}"
            f" {rr.waited:7d} {rr.rejected:8d}"
        )
    for rr in replays:
        x = rr.extra
        if "mig_tasks" in x:
            waited = (
                f"; while tasks waited {rr.avg_unallocated:.1%} of the GPUs and"
                f" {x['mig_avg_unallocated']:.1%} of the MIG GPUs' compute were unallocated"
                if rr.waited
                else ""
            )
            typer.echo(
                f"{rr.policy}: MIG tasks {x['mig_tasks']:.0f} ({x['mig_rejected']:.0f} rejected), avg JCT"
                f" {x['mig_avg_jct_s']:.0f} s, avg wait {x['mig_avg_wait_s']:.1f} s{waited}"
            )
    for line in refused:
        typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add `gpuyard sim` to the CLI."""
    app.command("sim")(sim)


def _failure_model(name: str) -> Any:
    """The failure model ``--failures`` names (None for ``none``)."""
    from gpuyard.errors import ConfigError
    from gpuyard.fabric.failures import LLAMA3_405B

    models = {"none": None, "llama3-405b": LLAMA3_405B}
    if name not in models:
        raise ConfigError(f"--failures {name!r}: choose {', '.join(models)}")
    return models[name]


def _elastic_jobs(jobs: list[Any], share: float, seed: int) -> dict[int, tuple[int, int]]:
    """``share`` of the jobs, drawn with ``seed``, made elastic: half to twice the GPUs asked for."""
    if share <= 0:
        return {}
    import numpy as np

    pick = np.random.default_rng(seed).random(len(jobs)) < share
    return {j.id: (max(1, j.gpus // 2), 2 * j.gpus) for j, chosen in zip(jobs, pick, strict=True) if chosen}
