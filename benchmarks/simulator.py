"""Benchmark: replay the Philly trace (82,247 jobs) through the scheduler's policies on a virtual cluster.

Two figures: how long a whole replay takes on 64 nodes x 8 GPUs (the target is under 60 s), and the
quality of each policy on 80 x 8 by average JCT. The baseline is FIFO with EASY backfill
(``fifo-backfill``: what Slurm-style schedulers run; plain ``fifo`` is shown beside it). The reference
is preemptive shortest-remaining-time-first with the true run times (``srtf-oracle``: not available to
a real scheduler), charged the same preemption costs as every policy; non-preemptive ``sjf-oracle`` is
shown beside it. The floor no policy can beat is the mean run time (every job starting at submit).

Last line: ``simulator: best_vs_oracle=<best / srtf-oracle> best_vs_sjf_oracle=<x>
backfill_vs_best=<fifo-backfill / best> fifo_vs_best=<x> best_excess_s=<best - floor>
oracle_excess_s=<srtf-oracle - floor> ... best=<name>`` (ratios of average JCT).

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
    ap.add_argument("--smoke", action="store_true", help="CI: --quick on the trace's first 500 jobs")
    args = ap.parse_args()
    args.quick = args.quick or args.smoke
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    if args.smoke:
        trace = trace[:500]
    load_s = time.perf_counter() - t0
    print(f"trace: {len(trace)} jobs, loaded in {load_s:.2f} s")

    speed = {}
    for name in ("fifo",) if args.quick else ("fifo", "las"):
        t0 = time.perf_counter()
        simulate(trace, uniform_cluster(64, 8), make_policy(name))
        speed[name] = time.perf_counter() - t0
        print(f"replay 64x8 {name:>10}: {speed[name]:6.1f} s")

    policies = (
        ("fifo", "fifo-backfill", "sef", "las", "sjf-oracle", "srtf-oracle")
        if args.quick
        else ("fifo", "fifo-backfill", "priority", "fair", "sef", "las", "sjf-oracle", "srtf-oracle")
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
    floor = sum(j.duration for j in trace) / len(trace)
    print(f"best policy without an oracle: {best}; floor (mean run time, no waiting): {floor:.0f} s")
    print(
        f"simulator: best_vs_oracle={jct[best] / jct['srtf-oracle']:.3f} "
        f"best_vs_sjf_oracle={jct[best] / jct['sjf-oracle']:.3f} "
        f"backfill_vs_best={jct['fifo-backfill'] / jct[best]:.2f} fifo_vs_best={jct['fifo'] / jct[best]:.2f} "
        f"best_excess_s={jct[best] - floor:.0f} oracle_excess_s={jct['srtf-oracle'] - floor:.0f} "
        f"sef_vs_oracle={jct['sef'] / jct['srtf-oracle']:.3f} replay_64x8_s={max(speed.values()):.1f} "
        f"jobs={len(trace)} best={best}"
    )


if __name__ == "__main__":
    main()
