"""Benchmark: placement decisions per second on a 1,000-node virtual cluster with 5,000 queued jobs.

gpuyard's vectorised placement (NumPy over the free-GPU array) against the plain-Python best-fit scan
one would write first (a loop over node records). Both make the same decisions on the same sequence:
5,000 jobs with the Philly size mix arriving at a cluster at 70% load, with jobs ending as it fills.
Then whole policy passes over the 5,000-job queue (what the server does each tick).

    python benchmarks/placement.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

from gpuyard.scheduler.placement import ClusterState, Placement, place, uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob

NODES, GPUS, QUEUED = 1000, 8, 5000
# GPU counts of the Philly trace's jobs (93% ask for one).
SIZES = [1] * 930 + [2] * 22 + [4] * 23 + [8] * 20 + [16] * 3 + [32] * 2


def _naive_place(free: list[int], gpus: int) -> list[tuple[int, int]] | None:
    best = None
    for i, f in enumerate(free):  # best fit on one node
        if f >= gpus and (best is None or f < free[best]):
            best = i
    if best is not None:
        return [(best, gpus)]
    if sum(free) < gpus:
        return None
    chosen, left = [], gpus
    for i in sorted(range(len(free)), key=lambda i: -free[i]):
        take = min(free[i], left)
        if take:
            chosen.append((i, take))
            left -= take
        if not left:
            return chosen
    return None


def _workload(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    occupancy = [rng.choice([0, 2, 4, 6, 8, 8, 8]) for _ in range(NODES)]
    jobs = [rng.choice(SIZES) for _ in range(QUEUED)]
    return occupancy, jobs


def bench_gpuyard(occupancy: list[int], jobs: list[int]) -> tuple[float, int]:
    state = ClusterState(uniform_cluster(NODES, GPUS, nodes_per_leaf=32))
    state.free[:] = [GPUS - o for o in occupancy]
    held: list[Placement] = []
    placed = 0
    t0 = time.perf_counter()
    for g in jobs:
        p = place(state, g)
        if p is None:
            while held and p is None:  # jobs end until it fits
                state.release(held.pop(0))
                p = place(state, g)
        if p is not None:
            state.take(p)
            held.append(p)
            placed += 1
    return time.perf_counter() - t0, placed


def bench_naive(occupancy: list[int], jobs: list[int]) -> tuple[float, int]:
    free = [GPUS - o for o in occupancy]
    held: list[list[tuple[int, int]]] = []
    placed = 0
    t0 = time.perf_counter()
    for g in jobs:
        p = _naive_place(free, g)
        while p is None and held:
            for i, n in held.pop(0):
                free[i] += n
            p = _naive_place(free, g)
        if p is not None:
            for i, n in p:
                free[i] -= n
            held.append(p)
            placed += 1
    return time.perf_counter() - t0, placed


def bench_pass(occupancy: list[int], jobs: list[int], policy_name: str) -> tuple[float, int]:
    state = ClusterState(uniform_cluster(NODES, GPUS, nodes_per_leaf=32))
    state.free[:] = [GPUS - o for o in occupancy]
    policy = make_policy(policy_name)
    queue = JobQueue(policy.key)
    for i, g in enumerate(jobs):
        queue.add(QueuedJob(i, g, team=f"t{i % 8}", submit_time=float(i), estimate=60.0 * (1 + i % 50)))
    t0 = time.perf_counter()
    decision = policy.decide(state, queue, [], now=float(QUEUED))
    return time.perf_counter() - t0, len(decision.starts)


def main() -> None:
    """Run both placements side by side; print the summary line last."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one repetition")
    ap.add_argument("--smoke", action="store_true", help="CI: the same as --quick (a few seconds)")
    args = ap.parse_args()
    reps = 1 if args.quick or args.smoke else 3
    ours, naive = [], []
    for rep in range(reps):
        occupancy, jobs = _workload(rep)
        t, placed = bench_gpuyard(occupancy, jobs)
        ours.append(len(jobs) / t)
        tn, placed_n = bench_naive(occupancy, jobs)
        naive.append(len(jobs) / tn)
        print(
            f"rep {rep}: gpuyard {len(jobs) / t:8.0f} decisions/s ({placed} placed), "
            f"naive {len(jobs) / tn:8.0f} decisions/s ({placed_n} placed)"
        )
    occupancy, jobs = _workload(0)
    for name in ("fifo", "sef", "fair"):
        t, started = bench_pass(occupancy, jobs, name)
        print(f"policy pass {name:>5}: {t * 1000:7.1f} ms over {QUEUED} queued, {started} started")
    best_ours, best_naive = max(ours), max(naive)
    print(
        f"placement: vs_naive={best_ours / best_naive:.1f} decisions_per_s={best_ours:.0f} "
        f"naive_decisions_per_s={best_naive:.0f} nodes={NODES} queued={QUEUED}"
    )


if __name__ == "__main__":
    main()
