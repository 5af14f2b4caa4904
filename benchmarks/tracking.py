"""Cost of tracking a training run in the state store, against JSON lines and against no tracking.

The same loop (a small MLP on scikit-learn's digits, batch 64, AdamW, one thread) runs with the
training runtime's NullTracker, its JsonlTracker (JSON lines in the run folder, the default) and
gpuyard's DbTracker (SQLite state store, points buffered and written in batches), logging loss,
learning rate, samples/s and step time every step. Also the raw cost of one ``log_metrics`` call.

    python benchmarks/tracking.py [--quick]

Last line: ``tracking: db_overhead_pct=... jsonl_overhead_pct=... db_us_per_call=... jsonl_us_per_call=...``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def train_loop(tracker: Any, steps: int) -> float:
    """Seconds for ``steps`` optimizer steps logging 4 metrics each."""
    import torch
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.as_tensor(X / 16.0, dtype=torch.float32)
    y = torch.as_tensor(y)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(X), (64,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(X[idx]), y[idx])
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        tracker.log_metrics(
            step, {"loss": loss.item(), "lr": 1e-3, "samples_per_s": 64 / dt, "step_time_s": dt}
        )
    tracker.finish("completed")
    return time.perf_counter() - start


def per_call_us(tracker: Any, calls: int) -> float:
    """Microseconds per log_metrics call (4 metrics), including the final flush."""
    start = time.perf_counter()
    for step in range(calls):
        tracker.log_metrics(
            step, {"loss": 1.0 / (step + 1), "lr": 1e-3, "samples_per_s": 1e4, "step_time_s": 1e-3}
        )
    tracker.finish("completed")
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    parser.add_argument("--smoke", action="store_true", help="CI: 50 steps, one repeat (no figure)")
    args = parser.parse_args()
    steps, repeats, calls = (1500, 3, 5000) if args.quick else (5000, 5, 20000)
    if args.smoke:
        steps, repeats, calls = 50, 1, 200
    home = Path(tempfile.mkdtemp(prefix="gpuyard-bench-tracking-"))
    os.environ["GPUYARD_HOME"] = str(home)
    import torch

    torch.set_num_threads(1)
    from gpuyard.tracking.files import JsonlTracker, NullTracker
    from gpuyard.tracking.store import start_run

    makers = {
        "none": lambda i: NullTracker(),
        "jsonl": lambda i: JsonlTracker(home / f"run-{i}"),
        "db": lambda i: start_run("bench", experiment="bench", system_interval_s=None),
    }
    times: dict[str, list[float]] = {k: [] for k in makers}
    train_loop(NullTracker(), 200)  # warm-up: first-touch allocations and lazy imports
    for i in range(repeats):  # interleaved, so a slow moment of the machine hits all three alike
        for name, make in makers.items():
            times[name].append(train_loop(make(i), steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    us = {k: per_call_us(makers[k](100 + i), calls) for i, k in enumerate(("jsonl", "db"))}
    for name in makers:
        print(f"{name:>6}: {med[name] / steps * 1e6:8.1f} us/step  (median of {repeats} x {steps} steps)")
    print(f"log_metrics call (4 metrics): jsonl {us['jsonl']:.1f} us, db {us['db']:.1f} us ({calls} calls)")
    db_pct = (med["db"] / med["none"] - 1) * 100
    jsonl_pct = (med["jsonl"] / med["none"] - 1) * 100
    print(
        f"tracking: db_overhead_pct={db_pct:.2f} jsonl_overhead_pct={jsonl_pct:.2f} "
        f"db_us_per_call={us['db']:.1f} jsonl_us_per_call={us['jsonl']:.1f} steps={steps}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
