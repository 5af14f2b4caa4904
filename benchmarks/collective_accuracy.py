"""Collective model accuracy: predict every row of the published nccl-tests corpus and report the error.

Each row of ``src/gpuyard/fabric/published/collectives.yaml`` is predicted on its cluster preset (with
the algorithm forced where the source forced one through ``NCCL_ALGO``); the error is
``predicted busbw / measured busbw - 1`` (the same as the time ratio's inverse), with the measured busbw
taken from the row's time when the source prints one (its busbw column is rounded to 0.01 GB/s).

The two fitted constants, ``collectives.LAUNCH_US`` and ``collectives.SIMPLE_FILL_BYTES``, are refitted
here on all sources and, for the leave-one-source-out check, on all sources but the one predicted.

    python benchmarks/collective_accuracy.py [--smoke]

``--smoke`` (CI): the leave-one-source-out check for the first source only; the summary line's figures
are the full ones (they need no refit).

Last line: ``collective_accuracy: median_pct=<x> max_pct=<y> small_median_pct=<z> rows=<n> sources=<k>``
(small = rows below 4 MiB).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache

from gpuyard.fabric import collectives
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.collectives import bus_factor, estimate
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.published.nccl import CollectiveRow, load_collectives

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SMALL = 4 * MiB
BANDS = (
    ("< 64 KiB", 0, 64 * KiB),
    ("64 KiB - 4 MiB", 64 * KiB, 4 * MiB),
    ("4 - 64 MiB", 4 * MiB, 64 * MiB),
    ("64 MiB - 1 GiB", 64 * MiB, GiB),
    (">= 1 GiB", GiB, 1 << 62),
)


def measured_time_us(row: CollectiveRow) -> float:
    """The row's time: printed, or recovered from its busbw."""
    if row.time_us is not None:
        return row.time_us
    assert row.busbw_GBps is not None
    algbw = row.busbw_GBps / bus_factor(row.op, row.gpus)
    return row.size_bytes / (algbw * 1e3)


@cache
def cluster(name: str) -> Cluster:
    """A preset, read once."""
    return load_cluster(name)


def predicted_time_us(row: CollectiveRow) -> float:
    """The model's time for the row, on its preset, with the source's forced algorithm if any."""
    est = estimate(cluster(row.system), row.op, row.gpus, row.size_bytes, algorithm=row.algorithm)
    return est.time_s * 1e6


def error_pct(row: CollectiveRow) -> float:
    """Signed error of predicted busbw against measured, percent (positive: the model is optimistic)."""
    return (measured_time_us(row) / predicted_time_us(row) - 1) * 100


@contextmanager
def constants(launch: float, fill: float) -> Iterator[None]:
    """Run with ``collectives.LAUNCH_US`` and ``SIMPLE_FILL_BYTES`` set (restored afterwards)."""
    old = collectives.LAUNCH_US, collectives.SIMPLE_FILL_BYTES
    collectives.LAUNCH_US, collectives.SIMPLE_FILL_BYTES = launch, fill
    collectives.collective_time.cache_clear()
    try:
        yield
    finally:
        collectives.LAUNCH_US, collectives.SIMPLE_FILL_BYTES = old
        collectives.collective_time.cache_clear()


def fit(rows: Iterable[CollectiveRow]) -> tuple[float, float]:
    """(LAUNCH_US, SIMPLE_FILL_BYTES) that minimise the mean |error| over ``rows``.

    A grid: the launch cost in 1 us steps (0-30 us), the fill in 2 MB steps (0-40 MB).
    """
    rows = list(rows)
    best = (math.inf, 0.0, 0.0)
    for us in range(0, 31):
        for mb in range(0, 41, 2):
            with constants(float(us), mb * 1e6):
                mean = statistics.fmean(abs(error_pct(r)) for r in rows)
            best = min(best, (mean, float(us), mb * 1e6))
    return best[1], best[2]


def _summary(errors: list[float]) -> str:
    a = [abs(e) for e in errors]
    return f"{len(a):5d} {statistics.median(a):8.1f} {statistics.mean(a):8.1f} {max(a):8.1f}"


def main() -> None:
    """Print the per-source and per-band tables, the fit and the summary line."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="accepted for `make bench`: the run is the same")
    ap.add_argument("--smoke", action="store_true", help="CI: leave-one-source-out for one source only")
    args = ap.parse_args()
    rows = load_collectives().rows
    sources = sorted({r.source for r in rows})
    launch, fill = fit(rows)
    print(
        f"fitted on all sources: LAUNCH_US={launch:.1f} us SIMPLE_FILL_BYTES={fill / 1e6:.0f} MB "
        f"(shipped: {collectives.LAUNCH_US:.1f} us, {collectives.SIMPLE_FILL_BYTES / 1e6:.0f} MB)"
    )

    errors = {id(r): error_pct(r) for r in rows}
    header = f"{'':28s} {'rows':>5s} {'median%':>8s} {'mean%':>8s} {'max%':>8s}"
    print("\nper source (|busbw error|, shipped constants)")
    print(header)
    for s in sources:
        errs = [errors[id(r)] for r in rows if r.source == s]
        tol = next(r.tolerance_pct for r in rows if r.source == s)
        print(f"{s:28s} {_summary(errs)}   tolerance {tol:.0f}%")
    print("\nper size band")
    print(header)
    for name, lo, hi in BANDS:
        errs = [errors[id(r)] for r in rows if lo <= r.size_bytes < hi]
        if errs:
            print(f"{name:28s} {_summary(errs)}")

    print("\nleave-one-source-out (both constants fitted on the other sources)")
    print(f"{'':28s} {'us':>6s} {'MB':>4s} {'median%':>8s} {'max%':>8s}")
    loso: list[float] = []
    for s in sources[:1] if args.smoke else sources:
        held_launch, held_fill = fit(r for r in rows if r.source != s)
        with constants(held_launch, held_fill):
            errs = [abs(error_pct(r)) for r in rows if r.source == s]
        loso += errs
        print(
            f"{s:28s} {held_launch:6.1f} {held_fill / 1e6:4.0f} "
            f"{statistics.median(errs):8.1f} {max(errs):8.1f}"
        )
    print(f"{'all (held out)':28s} {'':11s} {statistics.median(loso):8.1f} {max(loso):8.1f}")

    print("\nworst rows")
    worst = sorted(rows, key=lambda r: -abs(errors[id(r)]))[:8]
    for r in worst:
        est = estimate(cluster(r.system), r.op, r.gpus, r.size_bytes, algorithm=r.algorithm)
        print(
            f"  {r.source:24s} {r.op:14s} {r.gpus:3d} GPUs {r.size_bytes:>11d} B  "
            f"measured {measured_time_us(r):9.1f} us  model {est.time_s * 1e6:9.1f} us "
            f"({est.algorithm}/{est.protocol})  {errors[id(r)]:+6.1f}%"
        )

    absolute = [abs(e) for e in errors.values()]
    small = [abs(errors[id(r)]) for r in rows if r.size_bytes < SMALL]
    print(
        f"collective_accuracy: median_pct={statistics.median(absolute):.1f} max_pct={max(absolute):.1f} "
        f"small_median_pct={statistics.median(small):.1f} rows={len(rows)} sources={len(sources)}"
    )


if __name__ == "__main__":
    main()
