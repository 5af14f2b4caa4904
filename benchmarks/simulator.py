"""Benchmark: replay the Philly trace (82,247 jobs) through the scheduler's policies on a virtual cluster.

Two figures: how long a whole replay takes on 64 nodes x 8 GPUs (the target is under 60 s), and the
quality of each policy on 80 x 8: average JCT against FIFO (the baseline) and against shortest-job-
first with an oracle (true run times, not available to a real scheduler).

    python benchmarks/simulator.py [--quick] [--trace ../shared/traces/philly.csv]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import simulate
from gpuyard.scheduler.trace import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly.csv"


def main() -> None:
    """Run the replays and print a table, then the one-line summary."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer policies (about a minute)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    print(f"trace: {len(trace)} jobs, loaded in {load_s:.2f} s")

    speed = {}
    for name in ("fifo",) if args.quick else ("fifo", "las"):
        t0 = time.perf_counter()
        simulate(trace, uniform_cluster(64, 8), make_policy(name))
        speed[name] = time.perf_counter() - t0
        print(f"replay 64x8 {name:>10}: {speed[name]:6.1f} s")

    policies = (
        ("fifo", "sef", "las", "sjf-oracle")
        if args.quick
        else ("fifo", "priority", "fair", "sef", "las", "sjf-oracle")
    )
    jct = {}
    print(
        f"{'policy':>10} {'avg JCT s':>10} {'median s':>9} {'p99 s':>9} {'queue s':>9} "
        f"{'util':>6} {'preempt':>7}"
    )
    for name in policies:
        r = simulate(trace, uniform_cluster(80, 8), make_policy(name))
        jct[name] = r.avg_jct_s
        print(
            f"{name:>10} {r.avg_jct_s:10.0f} {r.median_jct_s:9.0f} {r.p99_jct_s:9.0f} {r.avg_queue_s:9.0f} "
            f"{r.utilization:6.1%} {r.preemptions:7d}"
        )
    best = min((n for n in jct if "oracle" not in n), key=jct.__getitem__)
    print(f"best policy without an oracle: {best}")
    print(
        f"simulator: best_vs_oracle={jct[best] / jct['sjf-oracle']:.3f} "
        f"fifo_vs_best={jct['fifo'] / jct[best]:.2f} "
        f"sef_vs_oracle={jct['sef'] / jct['sjf-oracle']:.3f} replay_64x8_s={max(speed.values()):.1f} "
        f"jobs={len(trace)} best={best}"
    )


if __name__ == "__main__":
    main()
