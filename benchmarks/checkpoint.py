"""Training stall per checkpoint: gpuyard's in-memory snapshot vs a synchronous DCP save, and recovery.

One Trainer run (one process, CPU, an MLP whose model + AdamW state is --hidden/--layers sized)
takes a checkpoint every --every steps, alternating the two kinds on the same state:

* memory: ``Trainer.snapshot()``: buffers (none in an MLP) copied into reused host buffers in the
  training thread; parameters and optimizer state copied by a background thread while the next
  forward and backward run (the next optimizer step waits for that copy: counted in the stall),
  then the serialised snapshot written to /dev/shm (and, with more ranks, sent to the next rank);
* sync: ``Trainer.save_checkpoint()``: ``torch.distributed.checkpoint.save`` of the same state to
  storage (a folder on this machine's disk, files fsynced as DCP does by default), the per-rank file
  and the completeness marker, in the training thread.

The stall is the time the training thread spends in the call (both include ``get_state_dict``),
plus for a snapshot any wait before the next optimizer step.
Before each sync save the benchmark waits, outside the timing, for the previous snapshot's
background work, so neither kind is charged for the other. After the last checkpoint the run is
cut short (an exception, as a dying process leaves no checkpoint), and a fresh process resumes it
twice: from the snapshot in /dev/shm, then with /dev/shm emptied, from the newest storage
checkpoint. ``recovery_s`` is the memory resume inside the new process (snapshot read, state
loaded into model and optimizer), ``restart_s`` the whole new process (Python and torch start-up,
model build, resume).

Last line: ``checkpoint: stall_ratio=<sync stall / in-memory stall> recovery_s=<x> ...`` (medians).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpuyard.tracking.files import read_metrics
from gpuyard.train import examples as ex
from gpuyard.train.memory_checkpoint import SNAPSHOT_DIR_ENV
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer

IN, CLASSES, BATCH = 256, 10, 32


class Stop(RuntimeError):
    """Ends the measured run after its last checkpoint, as a failure would (no final checkpoint)."""


def make_spec(run_dir: Path, hidden: int, layers: int, steps: int) -> TrainSpec:
    return TrainSpec.model_validate(
        {
            "name": "ckpt-bench",
            "run_dir": str(run_dir),
            "seed": 0,
            "data": {"batch_size": BATCH},
            "optimizer": {"name": "adamw", "lr": 1e-4},
            "max_steps": steps + 10,
            # Memory on (the snapshot folder and side group exist) but never taken by the loop:
            # the benchmark's callback takes both kinds itself.
            "checkpoint": {"every_steps": 0, "at_epoch_end": False, "final": False, "memory_every": 10**9},
            "tracking": "jsonl",
        }
    )


def make_trainer(spec: TrainSpec, hidden: int, layers: int, callbacks: list[Any]) -> Trainer:
    return Trainer(
        spec,
        model=lambda: ex.mlp(in_features=IN, hidden=hidden, out_features=CLASSES, layers=layers),
        train_data=ex.classification_data(BATCH * (spec.max_steps or 1), in_features=IN, classes=CLASSES),
        callbacks=callbacks,
    )


def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The training run with alternating checkpoints; returns the stalls and step times."""
    spec = make_spec(run_dir, args.hidden, args.layers, args.steps)
    out: dict[str, Any] = {"memory": [], "memory_steps": [], "sync": [], "background": [], "steps": []}
    last = {"t": time.perf_counter()}
    checkpoints = args.steps // args.every

    def callback(trainer: Trainer, event: str) -> None:
        if event != "step":
            return
        now = time.perf_counter()
        out["steps"].append((trainer.step, now - last["t"]))
        k, rest = divmod(trainer.step, args.every)
        if rest == 0 and 1 <= k <= checkpoints:
            assert trainer.memory is not None
            if k % 2 == 0:  # the last one is a snapshot: newer than storage (memory_every < persist_every)
                out["memory"].append(trainer.snapshot())
                out["memory_steps"].append(trainer.step)
            else:
                trainer.memory.wait()  # outside the timing: the previous snapshot's background work
                out["background"].append(trainer.memory.last_background_s)
                start = time.perf_counter()
                trainer.save_checkpoint("bench")
                out["sync"].append(time.perf_counter() - start)
        if trainer.step == checkpoints * args.every + 1:
            assert trainer.memory is not None
            trainer.memory.wait()
            raise Stop()
        last["t"] = time.perf_counter()

    trainer = make_trainer(spec, args.hidden, args.layers, [callback])
    with contextlib.suppress(Stop):
        trainer.fit()
    assert trainer.memory is not None
    # The snapshot's stall: the call, plus the wait before the next optimizer step for the
    # background copy of parameters and optimizer state (0 when it was done by then).
    waits = [trainer.memory.copy_waits.get(step, 0.0) for step in out["memory_steps"]]
    out["copy_wait"] = waits
    out["memory"] = [call + wait for call, wait in zip(out["memory"], waits, strict=True)]
    out["state_mb"] = (
        sum(
            t.numel() * t.element_size()
            for t in list(trainer.model.state_dict().values())
            + [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )
        / 2**20
    )
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    return out


def resume_child(args: argparse.Namespace) -> None:
    """In a fresh process: build the trainer and resume (setup), then print the resume event."""
    spec = make_spec(Path(args.run_dir), args.hidden, args.layers, args.steps)
    trainer = make_trainer(spec, args.hidden, args.layers, [])
    trainer.setup()
    event = [e for e in read_metrics(spec.resolved_run_dir()) if e["event"] == "resume"][-1]
    print(json.dumps(event))


def restart(args: argparse.Namespace, run_dir: Path, env: dict[str, str]) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, __file__, "--resume-child", "--run-dir", str(run_dir)]
    cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer checkpoints (< 30 s)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=10, help="checkpoints in all (half of each kind)")
    parser.add_argument("--storage", default=None, help="folder for the run (storage); default: a temp dir")
    parser.add_argument("--resume-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    if args.resume_child:
        resume_child(args)
        return
    if args.quick:
        args.hidden, args.layers, args.checkpoints, args.every = 2048, 4, 6, 3
    args.steps = args.every * args.checkpoints

    storage = Path(tempfile.mkdtemp(prefix="gpuyard-ckpt-bench-", dir=args.storage))
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    snapshots = shm / f"gpuyard-ckpt-bench-{os.getpid()}"
    os.environ[SNAPSHOT_DIR_ENV] = str(snapshots)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1")}
    try:
        run_dir = storage / "run"
        res = measure(args, run_dir)
        from_memory, restart_memory = restart(args, run_dir, env)
        shutil.rmtree(snapshots, ignore_errors=True)
        from_storage, restart_storage = restart(args, run_dir, env)
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    assert from_memory["source"] == "memory", from_memory
    assert from_storage["source"] == "storage", from_storage

    mem, sync = statistics.median(res["memory"]), statistics.median(res["sync"])
    step = statistics.median(t for _, t in res["steps"])
    times = dict(res["steps"])
    after = {s + 1 for s in res["memory_steps"]}
    # The steps after a snapshot run beside its background copy and serialisation (on 2 cores
    # here, they slow down): their extra time over the median step, up to the next checkpoint,
    # is a cost the stall does not show. The same for the steps after a sync save, to compare.
    step_after = statistics.median(t for s, t in res["steps"] if s in after)

    def extra(steps: list[int]) -> float:
        return statistics.median(
            sum(max(0.0, times.get(s + i, step) - step) for i in range(1, args.every)) for s in steps
        )

    sync_steps = [s for s in range(args.every, args.steps + 1, args.every) if s not in res["memory_steps"]]
    mem_extra, sync_extra = extra(res["memory_steps"]), extra(sync_steps)
    cost_ratio = (sync + sync_extra) / (mem + mem_extra)
    mem_mean = statistics.mean(res["memory"])
    ratio_mean = statistics.mean(res["sync"]) / mem_mean
    print(
        f"state {res['state_mb']:.0f} MiB (model {res['params'] / 1e6:.1f} M params + AdamW), "
        f"step {step * 1e3:.0f} ms (the step after a snapshot: {step_after * 1e3:.0f} ms), "
        f"{len(res['memory'])} snapshots + {len(res['sync'])} sync saves"
    )
    print(
        f"stall per checkpoint: in-memory {mem * 1e3:.1f} ms (all: "
        + ", ".join(f"{s * 1e3:.1f}" for s in res["memory"])
        + f"), sync DCP {sync * 1e3:.0f} ms (all: "
        + ", ".join(f"{s * 1e3:.0f}" for s in res["sync"])
        + ")"
    )
    print(
        "of which waiting before the next optimizer step for the background copy: "
        + ", ".join(f"{w * 1e3:.1f}" for w in res["copy_wait"])
        + " ms"
    )
    print(
        f"extra time of the steps up to the next checkpoint (median): after a snapshot "
        f"{mem_extra * 1e3:.0f} ms, after a sync save {sync_extra * 1e3:.0f} ms; stall + that: "
        f"{(mem + mem_extra) * 1e3:.0f} ms vs {(sync + sync_extra) * 1e3:.0f} ms"
    )
    print(
        f"snapshot background work (serialise + /dev/shm write, off the training thread): "
        f"{statistics.median(res['background']):.2f} s"
    )
    print(
        f"recovery: from memory {from_memory['seconds']:.3f} s (step {from_memory['step']}), "
        f"from storage {from_storage['seconds']:.3f} s (step {from_storage['step']}); "
        f"new process to resumed: {restart_memory:.1f} s / {restart_storage:.1f} s"
    )
    print(
        f"checkpoint: stall_ratio={sync / mem:.1f} stall_ratio_mean={ratio_mean:.1f} "
        f"cost_ratio={cost_ratio:.1f} "
        f"recovery_s={from_memory['seconds']:.3f} "
        f"recovery_storage_s={from_storage['seconds']:.3f} restart_s={restart_memory:.1f} "
        f"memory_stall_ms={mem * 1e3:.1f} sync_stall_ms={sync * 1e3:.0f} state_mib={res['state_mb']:.0f}"
    )


if __name__ == "__main__":
    main()
