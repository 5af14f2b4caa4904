"""Benchmark: fabric-aware vs topology-only placement, replaying the Philly trace on an oversubscribed fabric.

Both placements run the same trace on the same virtual cluster (a fabric preset, several leaf switches, an
oversubscribed spine), with the same seeded workloads (``gpuyard.scheduler.workloads``: a model per job
by its GPU count) and the same physics: a job placed where the fabric model predicts a slower step than
on its consolidated placement runs that much longer. Topology-only placement (the baseline) starts
every job on the best placement free now; fabric-aware placement may wait (at most ``--max-wait``) for a
consolidated one when the predicted slowdown over the job's expected run time outweighs the expected
wait.

    python benchmarks/fabric_placement.py [--quick] [--trace ../shared/traces/philly.csv]

The last line: ``fabric_placement: jct_ratio=... makespan_ratio=... ...`` (fabric / topology, headline
configuration: sef policy, 4:1 oversubscription; means over workload seeds, with the range of the JCT
ratio: a replay is chaotic, one changed decision reorders thousands of later ones, so single-seed
differences of a few percent are noise).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from gpuyard.fabric.presets import load_cluster
from gpuyard.scheduler.fabric_placement import FabricPlacer
from gpuyard.scheduler.nodes import nodes_from_fabric, with_network
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import SimResult, simulate
from gpuyard.scheduler.trace import TraceJob, load_trace
from gpuyard.scheduler.workloads import trace_workloads

SIZES = (1, 2, 4, 8, 16, 32)  # the big-job mix of the synthetic trace
SIZE_WEIGHTS = (30, 10, 15, 25, 15, 5)
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly.csv"
PRESET = "dgx-a100"  # 8x A100 per node, NVLink3 + NVSwitch, 8x HDR 200G
NODES = 80  # the cluster benchmarks/simulator.py uses for Philly
LEAF = 8  # nodes per leaf switch: 10 leaves


def run(
    trace: list[TraceJob], policy: str, oversub: float, placement: str, max_wait: float, seed: int
) -> tuple[SimResult, float]:
    """One replay; returns its result and wall seconds."""
    fabric = with_network(load_cluster(PRESET), LEAF, oversub)
    placer = FabricPlacer(fabric, max_wait) if placement == "fabric" else None
    t0 = time.perf_counter()
    result = simulate(
        trace,
        nodes_from_fabric(fabric, NODES),
        make_policy(policy, placer=placer),
        workloads=trace_workloads(trace, seed),
        fabric=fabric,
    )
    return result, time.perf_counter() - t0


def synthetic_trace(seed: int, load: float, jobs: int = 3000, nodes: int = 32) -> list[TraceJob]:
    """A big-job mix (sizes and weights in ``SIZES``), Poisson arrivals at ``load``.

    Run times are log-normal around an hour; ``load`` is the offered GPU load before any slowdown.
    """
    rng = random.Random(seed)
    mean_gpus = sum(s * w for s, w in zip(SIZES, SIZE_WEIGHTS, strict=True)) / sum(SIZE_WEIGHTS)
    mean_s = 3600 * math.exp(0.5)  # log-normal(ln 3600, 1)
    rate = load * nodes * 8 / (mean_gpus * mean_s)
    t, trace = 0.0, []
    for i in range(jobs):
        t += rng.expovariate(rate)
        gpus = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        trace.append(TraceJob(i, t, rng.lognormvariate(math.log(3600), 1.0), gpus, team=f"t{i % 4}"))
    return trace


def synthetic(loads: tuple[float, ...], seeds: int, max_wait: float) -> None:
    """Fabric vs topology on the big-job mix: 32 nodes, 4 per leaf, 4:1 spine, sef."""
    fabric = with_network(load_cluster(PRESET), 4, 4.0)
    nodes = nodes_from_fabric(fabric, 32)
    mix = dict(zip(SIZES, SIZE_WEIGHTS, strict=True))
    print(f"big-job mix (GPUs: weight {mix}), 32 nodes, 4 per leaf, 4:1, sef")
    for load in loads:
        ratios = []
        for seed in range(seeds):
            trace = synthetic_trace(seed, load)
            w = trace_workloads(trace, seed)
            jct = {}
            for placement in ("topology", "fabric"):
                placer = FabricPlacer(fabric, max_wait) if placement == "fabric" else None
                policy = make_policy("sef", placer=placer)
                jct[placement] = simulate(trace, nodes, policy, workloads=w, fabric=fabric).avg_jct_s
            ratios.append(jct["fabric"] / jct["topology"])
        print(
            f"  load {load:.1f}: avg JCT fabric/topology median x{statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f} over {seeds} seeds"
        )


def main() -> None:
    """Replay both placements per configuration, print a table, then the one-line summary."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the headline configuration only (about a minute)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--max-wait", type=float, default=600.0, help="fabric placement's cap on waiting (s)")
    ap.add_argument("--seeds", type=int, default=None, help="workload seeds per configuration (3)")
    ap.add_argument("--smoke", action="store_true", help="CI: --quick, one seed, the first 300 jobs")
    args = ap.parse_args()
    args.quick = args.quick or args.smoke
    seeds = list(range(1 if args.smoke else args.seeds or 3))
    trace = load_trace(args.trace)
    if args.smoke:
        trace = trace[:300]
    print(
        f"trace: {len(trace)} jobs; cluster: {NODES} x {PRESET} nodes, {LEAF} per leaf "
        f"({NODES // LEAF} leaves); max wait {args.max_wait:.0f} s; workload seeds {seeds}"
    )
    configs = [("sef", 4.0)]
    if not args.quick:
        configs += [("sef", 1.0), ("sef", 2.0), ("las", 4.0), ("fifo", 4.0)]
    print(
        f"{'policy':>6} {'oversub':>7} {'seed':>4} {'placement':>9} {'avg JCT s':>10} {'makespan s':>11} "
        f"{'queue s':>9} {'multi-node':>10} {'multi-leaf':>10} {'slowed':>7} {'waited':>7} {'util':>6} "
        f"{'wall s':>6}"
    )
    ratios: dict[tuple[str, float], dict[str, float]] = {}
    for policy, oversub in configs:
        per_seed: list[dict[str, float]] = []
        for seed in seeds:
            res = {}
            for placement in ("topology", "fabric"):
                r, wall = run(trace, policy, oversub, placement, args.max_wait, seed)
                res[placement] = r
                print(
                    f"{policy:>6} {oversub:>7.0f} {seed:>4} {placement:>9} {r.avg_jct_s:10.0f} "
                    f"{r.makespan_s:11.0f} {r.avg_queue_s:9.0f} {r.multi_node_jobs:10d} "
                    f"{r.multi_leaf_jobs:10d} {r.slowed_jobs:7d} {r.fabric_waits:7d} {r.utilization:6.1%} "
                    f"{wall:6.1f}"
                )
            topo, fab = res["topology"], res["fabric"]
            per_seed.append(
                {
                    "jct_ratio": fab.avg_jct_s / topo.avg_jct_s,
                    "makespan_ratio": fab.makespan_s / topo.makespan_s,
                    "queue_ratio": fab.avg_queue_s / topo.avg_queue_s if topo.avg_queue_s else math.nan,
                    "multi_leaf_share_topology": topo.multi_leaf_jobs / topo.jobs,
                    "multi_leaf_share_fabric": fab.multi_leaf_jobs / fab.jobs,
                    "slowed_topology": topo.slowed_jobs,
                    "slowed_fabric": fab.slowed_jobs,
                }
            )
        ratios[(policy, oversub)] = {k: statistics.mean(d[k] for d in per_seed) for k in per_seed[0]}
        ratios[(policy, oversub)]["jct_ratio_min"] = min(d["jct_ratio"] for d in per_seed)
        ratios[(policy, oversub)]["jct_ratio_max"] = max(d["jct_ratio"] for d in per_seed)
    for (policy, oversub), r in ratios.items():
        print(
            f"{policy} {oversub:.0f}:1  fabric/topology (mean of {len(seeds)} seeds): avg JCT "
            f"x{r['jct_ratio']:.3f} ({r['jct_ratio_min']:.3f}-{r['jct_ratio_max']:.3f}), "
            f"makespan x{r['makespan_ratio']:.3f}, multi-leaf jobs {r['multi_leaf_share_topology']:.2%} -> "
            f"{r['multi_leaf_share_fabric']:.2%}"
        )
    if not args.quick:
        synthetic((0.5, 0.6, 0.7), 8, args.max_wait)
    h = ratios[("sef", 4.0)]
    print(
        f"fabric_placement: jct_ratio={h['jct_ratio']:.3f} jct_ratio_min={h['jct_ratio_min']:.3f} "
        f"jct_ratio_max={h['jct_ratio_max']:.3f} makespan_ratio={h['makespan_ratio']:.3f} "
        f"queue_ratio={h['queue_ratio']:.3f} multi_leaf_topology={h['multi_leaf_share_topology']:.4f} "
        f"multi_leaf_fabric={h['multi_leaf_share_fabric']:.4f} slowed_topology={h['slowed_topology']:.0f} "
        f"slowed_fabric={h['slowed_fabric']:.0f} policy=sef oversubscription=4 nodes={NODES} leaf={LEAF}"
    )


if __name__ == "__main__":
    main()
