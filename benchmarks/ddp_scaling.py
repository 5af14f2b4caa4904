"""2-rank DDP scaling efficiency on gloo (CPU): gpuyard's Trainer vs a hand-written DDP loop.

Weak scaling: each rank keeps the per-rank batch, so 2 ranks process twice the samples per step.
efficiency = samples/s with 2 ranks / (2 x samples/s with 1 rank), from the steady state (steps
after a warm-up; best of the repeats), each rank on one intra-op thread (the machine has 2
cores). The baseline is the
DDP loop from the PyTorch tutorial (DistributedSampler, DDP, AdamW) in the configuration the
Trainer runs: AdamW with ``fused=True`` (what ``gpuyard.train.components.build_optimizer`` builds
for plain CPU/CUDA float parameters), fp32, no ``torch.compile``, so the two differ only in the
Trainer's own work. This script launches itself
under torchrun for each (implementation, ranks) pair.
Last line: `ddp_scaling: efficiency=<gpuyard> baseline_efficiency=<hand loop> ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PER_RANK_BATCH, IN, HIDDEN, CLASSES, SEED = 64, 256, 512, 10, 0


def _model() -> torch.nn.Module:
    from gpuyard.train import examples as ex

    return ex.mlp(in_features=IN, hidden=HIDDEN, out_features=CLASSES, layers=3)


def _data(n: int) -> torch.utils.data.TensorDataset:
    from gpuyard.train import examples as ex

    return ex.classification_data(n, in_features=IN, classes=CLASSES, seed=SEED)


def _throughput(stamps: list[float], warmup: int, world: int) -> float:
    steps = len(stamps) - 1 - warmup
    return steps * PER_RANK_BATCH * world / (stamps[-1] - stamps[warmup])


def worker_gpuyard(steps: int, run_dir: str) -> list[float]:
    from gpuyard.train.spec import TrainSpec
    from gpuyard.train.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    stamps: list[float] = []
    spec = TrainSpec.model_validate(
        {
            "run_dir": run_dir,
            "seed": SEED,
            "epochs": 1,
            "max_steps": steps,
            "data": {"batch_size": PER_RANK_BATCH},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "checkpoint": {"at_epoch_end": False, "final": False, "resume": False},
        }
    )
    trainer = Trainer(
        spec,
        model=_model,
        train_data=_data(PER_RANK_BATCH * world * (steps + 1)),
        callbacks=[lambda t, e: stamps.append(time.perf_counter()) if e == "step" else None],
    )
    trainer.fit()
    trainer.close()
    return stamps


def worker_baseline(steps: int) -> list[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    model = _model()
    if world > 1:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as the Trainer's
    data = _data(PER_RANK_BATCH * world * (steps + 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=int(os.environ["RANK"]), seed=SEED)
    stamps = []
    for i, (x, y) in enumerate(DataLoader(data, batch_size=PER_RANK_BATCH, sampler=sampler)):
        if i == steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.perf_counter())
    if world > 1:
        dist.destroy_process_group()
    return stamps


def run(impl: str, nproc: int, steps: int, warmup: int, tmp: Path) -> float:
    """Launch one configuration under torchrun; returns samples/s (all ranks)."""
    out = tmp / f"{impl}-{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--worker",
        impl,
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    return _throughput(json.loads(out.read_text()), warmup, nproc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument("--smoke", action="store_true", help="CI: 6 steps per run, every path (no figure)")
    parser.add_argument("--worker", choices=["gpuyard", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        run_dir = str(Path(args.out).with_suffix(".run"))  # shared by the ranks: checkpoints live there
        stamps = (
            worker_gpuyard(args.steps, run_dir) if args.worker == "gpuyard" else worker_baseline(args.steps)
        )
        if os.environ.get("RANK") == "0":
            Path(args.out).write_text(json.dumps(stamps))
        return
    steps, warmup, repeats = (150, 20, 1) if args.quick else (300, 40, 3)
    if args.smoke:
        steps, warmup, repeats = 6, 2, 1
    thr: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # Tracked runs go to a store of the benchmark's own, not the user's ~/.gpuyard.
        os.environ["GPUYARD_HOME"] = str(Path(tmp) / "home")
        os.environ.pop("GPUYARD_DATABASE_URL", None)
        # Rounds interleave the four configurations, and each keeps its best round: other work on a
        # shared machine only ever slows a run down, and interleaving spreads it over all of them.
        for _ in range(repeats):
            for impl in ("baseline", "gpuyard"):
                for nproc in (1, 2):
                    found = run(impl, nproc, steps, warmup, Path(tmp))
                    thr[impl, nproc] = max(thr.get((impl, nproc), 0.0), found)
                    print(f"{impl:9s} {nproc} rank(s): {found:8.0f} samples/s", flush=True)
    eff = {impl: thr[impl, 2] / (2 * thr[impl, 1]) for impl in ("gpuyard", "baseline")}
    print(
        f"ddp_scaling: efficiency={eff['gpuyard']:.3f} baseline_efficiency={eff['baseline']:.3f} "
        f"gpuyard_2rank_sps={thr['gpuyard', 2]:.0f} baseline_2rank_sps={thr['baseline', 2]:.0f} "
        f"per_rank_batch={PER_RANK_BATCH} steps={steps} backend=gloo optimizer=adamw-fused "
        f"load_avg={os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
