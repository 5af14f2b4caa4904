"""gpuyard's Trainer vs a hand-written PyTorch loop: same model, data, seed, batch, optimizer and device.

Both run one process with one intra-op thread; the Trainer runs with its per-step work on (loss
agreement, NaN check, metrics to metrics.jsonl each step, LR schedule) and checkpoints off (they
are I/O, measured elsewhere). The baseline is the loop a careful user writes, in the configuration
the Trainer itself runs (so the comparison is of the Trainer's own work, not of a slower
optimizer): DataLoader (no workers: on this machine the main process is faster for in-memory
tensors) over a DistributedSampler (so both see the same order and end with the same loss), AdamW
with ``fused=True`` (the Trainer's optimizer: ``gpuyard.train.components.build_optimizer`` fuses
AdamW wherever every parameter is a plain CPU/CUDA float tensor; the default foreach kernel is
several times slower on a CPU), LambdaLR, fp32 (the Trainer's ``precision: auto`` on a CPU), no
``torch.compile`` on either side (the Trainer's default), ``loss.item()`` every step for logging.
Device: the one the Trainer picks (``gpuyard.train.parallel.init_distributed``: the first CUDA GPU
when one is visible, else the CPU); on a GPU both sides run there with bf16 autocast (the Trainer's
``precision: auto`` on CUDA) and move each batch with ``non_blocking=True`` as the Trainer does. Hide
the GPUs (``CUDA_VISIBLE_DEVICES=``) for the CPU figure on a GPU machine; the last line names the device.
Runs alternate (baseline, Trainer, baseline, ...) so load on a shared machine hits both alike;
the median wall time of each is compared and the spread of the per-pair ratios is printed, with
``cpu_slowdown`` (the median per-pair ratio of the process's CPU time, all threads: waiting for a
core on a loaded machine does not count in it).
Per step and per run apart: each side stamps its thread's CPU time (``time.thread_time``) at the
end of every step (the loop after ``loss.item()``, the Trainer from its ``step`` callback);
``step_cpu_slowdown`` is the median per-pair ratio of the median step's CPU time, and
``fixed_cpu_s`` gpuyard's CPU time per run outside its steps less the loop's (set-up, the end of
the run, the tracking thread), each the median over runs.
Last line: `train_overhead: slowdown=<trainer/baseline - 1> ...`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpuyard.train import components as comp
from gpuyard.train import examples as ex
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer

SEED, LR, BATCH, IN, HIDDEN, CLASSES = 0, 1e-3, 64, 256, 512, 10
# The Trainer's device rule (parallel.init_distributed) and its precision: auto (bf16 on CUDA).
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def make_model() -> nn.Module:
    return ex.mlp(in_features=IN, hidden=HIDDEN, out_features=CLASSES, layers=3)


def make_data(n: int) -> TensorDataset:
    return ex.classification_data(n, in_features=IN, classes=CLASSES, seed=SEED)


def baseline(n: int, epochs: int, stamps: list[float] | None = None) -> tuple[float, float, float]:
    """The hand-written loop; returns (seconds, CPU seconds, final loss). ``stamps`` gets the thread's
    CPU time at the end of each step."""
    stamps = [] if stamps is None else stamps
    start, cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(SEED)
    model = make_model().to(DEVICE)
    # fused=True: what the Trainer builds for plain CPU/CUDA float parameters (build_optimizer).
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    data = make_data(n)
    # The sampler a DDP-ready loop uses (one replica here): the same order as gpuyard's.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    loss_value = float("nan")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=DEVICE.type == "cuda"):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_value = loss.item()
            stamps.append(time.thread_time())
    return time.perf_counter() - start, time.process_time() - cpu, loss_value


def gpuyard_run(
    n: int, epochs: int, run_dir: Path, stamps: list[float] | None = None
) -> tuple[float, float, float]:
    """The same training through gpuyard's Trainer; returns (seconds, CPU seconds, final loss).
    ``stamps`` gets the thread's CPU time at the end of each step."""
    stamps = [] if stamps is None else stamps
    start, cpu = time.perf_counter(), time.process_time()
    spec = TrainSpec.model_validate(
        {
            "run_dir": str(run_dir),
            "seed": SEED,
            "epochs": epochs,
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.0},
            "checkpoint": {"at_epoch_end": False, "final": False, "resume": False},
        }
    )
    stamp = stamps.append

    def on_step(trainer: Trainer, event: str) -> None:
        if event == "step":
            stamp(time.thread_time())

    result = Trainer(spec, model=make_model, train_data=make_data(n), callbacks=[on_step]).fit()
    return time.perf_counter() - start, time.process_time() - cpu, result.metrics["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument("--smoke", action="store_true", help="CI: 512 samples, 1 epoch, 1 pair (no figure)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, epochs, repeats = (4096, 3, 5) if args.quick else (8192, 4, 9)
    if args.smoke:
        n, epochs, repeats = 512, 1, 1
    base_t, ours_t, base_cpu, ours_cpu = [], [], [], []
    base_step, ours_step, base_fixed, ours_fixed = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        # gpuyard's runs are tracked in the state store by default, as a user's would be: a store of
        # its own, not the user's ~/.gpuyard.
        os.environ["GPUYARD_HOME"] = str(Path(tmp) / "home")
        os.environ.pop("GPUYARD_DATABASE_URL", None)
        baseline(1024, 1)  # warm-up (allocator, kernels) for both
        gpuyard_run(1024, 1, Path(tmp) / "warm")
        for i in range(repeats):  # the side that goes first alternates from pair to pair
            for side in ("baseline", "gpuyard") if i % 2 == 0 else ("gpuyard", "baseline"):
                stamps: list[float] = []
                if side == "baseline":
                    t, c, base_loss = baseline(n, epochs, stamps)
                    base_t.append(t)
                    base_cpu.append(c)
                    step, fixed = base_step, base_fixed
                else:
                    t, c, our_loss = gpuyard_run(n, epochs, Path(tmp) / f"run{i}", stamps)
                    ours_t.append(t)
                    ours_cpu.append(c)
                    step, fixed = ours_step, ours_fixed
                # The first step (allocations, the first batch) counts as per-run work.
                step.append(statistics.median(y - x for x, y in itertools.pairwise(stamps)))
                fixed.append(c - step[-1] * len(stamps))
    steps = n // BATCH * epochs
    b, o = statistics.median(base_t), statistics.median(ours_t)
    print(
        f"model {comp.count_parameters(make_model())} params, {steps} steps x batch {BATCH}, "
        f"{repeats} alternating runs, 1 thread, device {DEVICE}"
    )
    print(f"baseline  median {b:.3f} s  ({steps / b:.0f} steps/s)  final loss {base_loss:.4f}")
    print(f"gpuyard   median {o:.3f} s  ({steps / o:.0f} steps/s)  final loss {our_loss:.4f}")
    pairs = sorted(ours / base - 1 for ours, base in zip(ours_t, base_t, strict=True))
    print("slowdown per alternating pair: " + ", ".join(f"{x:+.4f}" for x in pairs))
    # CPU time of the process (all its threads): what load on a shared machine disturbs least.
    cpu = statistics.median(ours / base - 1 for ours, base in zip(ours_cpu, base_cpu, strict=True))
    bc, oc = statistics.median(base_cpu), statistics.median(ours_cpu)
    print(f"CPU time: baseline median {bc:.3f} s, gpuyard {oc:.3f} s")
    per_step = statistics.median(o / b - 1 for o, b in zip(ours_step, base_step, strict=True))
    fixed_s = statistics.median(ours_fixed) - statistics.median(base_fixed)
    print(
        f"per step (median step's CPU): baseline {statistics.median(base_step) * 1e3:.3f} ms, gpuyard "
        f"{statistics.median(ours_step) * 1e3:.3f} ms; per run outside the steps: baseline "
        f"{statistics.median(base_fixed):.3f} s, gpuyard {statistics.median(ours_fixed):.3f} s"
    )
    print(
        f"train_overhead: slowdown={o / b - 1:.4f} gpuyard_s={o:.3f} baseline_s={b:.3f} steps={steps} "
        f"same_final_loss={abs(base_loss - our_loss) < 1e-5} "
        f"pair_min={pairs[0]:.4f} pair_max={pairs[-1]:.4f} cpu_slowdown={cpu:.4f} "
        f"step_cpu_slowdown={per_step:.4f} fixed_cpu_s={fixed_s:.3f} "
        f"optimizer=adamw-fused device={DEVICE.type} load_avg={os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
