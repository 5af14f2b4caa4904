"""Training stall per checkpoint: gpuyard's in-memory snapshot vs DCP ``async_save`` (and a sync save).

One Trainer run (one process, CPU, an MLP whose model + AdamW state is --hidden/--layers sized)
takes a checkpoint every --every steps, the four kinds in turn on the same state:

* memory: ``Trainer.snapshot()``: buffers (none in an MLP) copied in the training thread;
  parameters and optimizer state copied by a background thread into a reused data file in
  /dev/shm mapped into the process while the next forward and backward run (the next optimizer
  step waits for that copy: counted in the stall);
* async: ``torch.distributed.checkpoint.async_save`` of the same state to storage with DCP's
  default stager (the state copied to CPU memory in the call, the files written by a thread);
* async_staged: the same with a reused ``DefaultStager(StagingOptions(use_async_staging=True))``:
  the copy too is done in the background and the next optimizer step waits for it (an optimizer
  step pre-hook), the way DCP's documentation describes overlapping the staging with compute;
* sync: ``Trainer.save_checkpoint()``: ``torch.distributed.checkpoint.save`` of the same state to
  storage, fsynced, in the training thread (shown beside: what a plain loop does);
* async_shm, async_staged_shm: the two async configurations writing into a folder in /dev/shm, the
  snapshot's own destination (memory, no disk): the equal-destination baseline for the whole cost.

What is equal: the same Trainer, model, optimizer state and steps; every kind takes the same state
dict at the same step interval, the kinds in turn (so load falls on all alike), and each kind's
earlier background work is waited for outside the timing. ``cost_ratio_vs_async`` compares the
snapshot with DCP writing to the same place (/dev/shm: ``async_shm``/``async_staged_shm``, the
better one); ``cost_ratio_vs_async_disk`` with DCP writing to storage (until 2026-11-29 the only
whole-cost figure, which compared a copy into memory with a write to disk).

The baseline is async DCP: it is what a competent user runs (gpuyard's own storage checkpoints
offer it, ``checkpoint.async_save``), and of its configurations the one that did better in the
run is compared against (lowest steady-state median stall for ``stall_ratio_vs_async``, lowest
whole cost for ``cost_ratio_vs_async``). Each kind's first checkpoint of the run (allocations, first
touch of its pages) is reported apart (``*_first_stall_ms``; gpuyard's data files are allocated
ahead, in the background from the second update, when the Trainer hands the checkpointer its
state: ``memory_prepare_s`` is that work's time, not in any stall unless the first snapshot had
to wait for it); stall medians are over the later ones
(steady state; 11 of each kind by default, 66 checkpoints in all). Not compared: DCP's
process-based checkpointer (``AsyncCheckpointerType.PROCESS``), which on a 2-core machine competes
for the same cores and starts a process on its first save.

The stall is the training thread's time in the call (all include ``get_state_dict``), plus any
wait before the next optimizer step. The whole cost adds the extra time of the steps up to the next
checkpoint over the median step: the background copies and writes run on the same cores as
training here and slow it down. Before each checkpoint the benchmark waits, outside the timing,
for the earlier ones' background work, so no kind is charged for another's. After the last
checkpoint (a snapshot) the run is cut short (an exception, as a dying process leaves no
checkpoint), and a fresh process resumes it twice: from the snapshot in /dev/shm, then with
/dev/shm emptied and the storage checkpoint's files evicted from the page cache
(``posix_fadvise(DONTNEED)`` on those files only; see ``evict_page_cache``), from the newest storage
checkpoint. ``recovery_*_s`` are the resume inside the new process (state read and loaded into
model and optimizer), ``restart_s`` the whole new process (start-up, model build, resume). The two
recoveries do not count the same check: the snapshot's SHA-256 check is inside
``recovery_memory_s``, the storage checkpoint's runs before the resume's timer
(``Trainer._intact_checkpoint``); both are printed (``memory_verify_s``, ``storage_verify_s``).

Last line: ``checkpoint: stall_ratio_vs_async=<async stall / in-memory stall>
cost_ratio_vs_async=<async whole cost / in-memory whole cost> ...`` (medians; above 1: gpuyard's
is smaller).
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
import warnings
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


class AsyncDCP:
    """``torch.distributed.checkpoint.async_save`` as a user calls it, in one of two configurations.

    ``staged=False``: DCP's default (the state copied to CPU memory inside the call, the write in a
    background thread). ``staged=True``: a reused ``DefaultStager`` with asynchronous staging (the
    copy too runs in the background; the next optimizer step waits for it, as for gpuyard's
    snapshot; pinned and shared memory are off: there is no GPU here and the writer is a thread).
    """

    def __init__(self, root: Path, staged: bool) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.staged = root, staged
        self.stager = DefaultStager(StagingOptions(False, False, True, False)) if staged else None
        self.upload: Any = None
        self.staging: Any = None
        self.waits: dict[int, float] = {}
        self._step = 0

    def save(self, trainer: Trainer) -> float:
        """Seconds in the call (state dict taken, staging started or done, write started)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        with warnings.catch_warnings():  # DCP warns that one process runs without a process group
            warnings.simplefilter("ignore")
            res = dcp.async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=str(self.root / f"step-{trainer.step:08d}"),
                async_stager=self.stager,
                no_dist=True,
            )
        self.upload = getattr(res, "upload_completion", res)
        self.staging = getattr(res, "staging_completion", None)
        self._step = trainer.step
        return time.perf_counter() - start

    def before_update(self) -> None:
        """Called before each optimizer step: the step may not change state still being staged."""
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.waits[self._step] = time.perf_counter() - start
            self.staging = None

    def wait(self) -> None:
        """The whole save done (outside any timing)."""
        self.before_update()
        if self.upload is not None:
            self.upload.result()
            self.upload = None


KINDS = ("memory", "sync", "async", "async_staged", "async_shm", "async_staged_shm")
ASYNC_KINDS = ("async", "async_staged", "async_shm", "async_staged_shm")


def measure(args: argparse.Namespace, run_dir: Path, shm_dir: Path) -> dict[str, Any]:
    """The training run with the four kinds of checkpoint in turn; returns the stalls and step times."""
    spec = make_spec(run_dir, args.hidden, args.layers, args.steps)
    out: dict[str, Any] = {"steps": [], "background": []}
    for kind in KINDS:
        out[kind], out[f"{kind}_steps"] = [], []
    last = {"t": time.perf_counter()}
    checkpoints = args.steps // args.every
    dcp_async = {
        "async": AsyncDCP(run_dir / "dcp-async", staged=False),
        "async_staged": AsyncDCP(run_dir / "dcp-async-staged", staged=True),
        "async_shm": AsyncDCP(shm_dir / "dcp-async", staged=False),
        "async_staged_shm": AsyncDCP(shm_dir / "dcp-async-staged", staged=True),
    }

    def quiesce(trainer: Trainer) -> None:
        """Outside the timing: the earlier checkpoints' background work done, so none is charged for
        another kind's."""
        assert trainer.memory is not None
        trainer.memory.wait()
        for saver in dcp_async.values():
            saver.wait()

    def callback(trainer: Trainer, event: str) -> None:
        if event != "step":
            return
        now = time.perf_counter()
        if not out["steps"]:  # the optimizer exists now: async staging must finish before an update

            def before_update(*_: Any) -> None:
                for saver in dcp_async.values():
                    saver.before_update()

            trainer.optimizer.register_step_pre_hook(before_update)
        out["steps"].append((trainer.step, now - last["t"]))
        k, rest = divmod(trainer.step, args.every)
        if rest == 0 and 1 <= k <= checkpoints:
            assert trainer.memory is not None
            # The last one is a snapshot (k % 4 == 0): newer than storage, as memory_every < persist_every.
            kind = KINDS[k % len(KINDS)]
            quiesce(trainer)
            if kind == "memory":
                out["background"].append(trainer.memory.last_background_s)
                out["memory"].append(trainer.snapshot())
            elif kind == "sync":
                start = time.perf_counter()
                trainer.save_checkpoint("bench")
                out["sync"].append(time.perf_counter() - start)
            else:
                out[kind].append(dcp_async[kind].save(trainer))
            out[f"{kind}_steps"].append(trainer.step)
        if trainer.step == checkpoints * args.every + 1:
            quiesce(trainer)
            raise Stop()
        last["t"] = time.perf_counter()

    trainer = make_trainer(spec, args.hidden, args.layers, [callback])
    with contextlib.suppress(Stop):
        trainer.fit()
    assert trainer.memory is not None
    # A snapshot's stall: the call, plus the wait before the next optimizer step for the background
    # copy of parameters and optimizer state (0 when it was done by then). The same for async DCP
    # with asynchronous staging (its staging is that copy).
    waits = {"memory": trainer.memory.copy_waits, **{k: dcp_async[k].waits for k in ASYNC_KINDS}}
    for kind, wait in waits.items():
        out[f"{kind}_wait"] = [wait.get(step, 0.0) for step in out[f"{kind}_steps"]]
        out[kind] = [call + w for call, w in zip(out[kind], out[f"{kind}_wait"], strict=True)]
    out["state_mb"] = (
        sum(
            t.numel() * t.element_size()
            for t in list(trainer.model.state_dict().values())
            + [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )
        / 2**20
    )
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    out["prepare_s"] = trainer.memory.prepare_s  # 0.0: the data files were not allocated ahead
    return out


def resume_child(args: argparse.Namespace) -> None:
    """In a fresh process: build the trainer and resume (setup), then print the resume event."""
    from gpuyard.train import persistence as trainer_module  # where the trainer's resume verifies

    spec = make_spec(Path(args.run_dir), args.hidden, args.layers, args.steps)
    trainer = make_trainer(spec, args.hidden, args.layers, [])
    # Profiling only: the storage checkpoint's SHA-256 check runs before the resume's timer
    # (``seconds`` excludes it), the snapshot's inside it (``seconds`` includes it): both shown.
    verify, spent = trainer_module.verify_checkpoint, [0.0]

    def timed_verify(*a: Any, **kw: Any) -> Any:
        began = time.perf_counter()
        try:
            return verify(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - began

    trainer_module.verify_checkpoint = timed_verify  # type: ignore[assignment]
    trainer.setup()
    event = [e for e in read_metrics(spec.resolved_run_dir()) if e["event"] == "resume"][-1]
    event["storage_verify_s"] = spent[0]
    event["memory_verify_s"] = trainer.memory.last_verify_s if trainer.memory is not None else 0.0
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
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=66,
        help=f"checkpoints in all ({len(KINDS)} kinds in turn: 11 of each by default)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CI: a tiny MLP, one checkpoint of each kind (no figure)"
    )
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
        args.hidden, args.layers, args.every = 2048, 4, 3
    if args.smoke:
        args.hidden, args.layers, args.every, args.checkpoints = 64, 2, 2, len(KINDS)
    if args.checkpoints < len(KINDS) or args.checkpoints % len(KINDS):
        parser.error(f"--checkpoints must be a multiple of {len(KINDS)} (the last one is a snapshot)")
    args.steps = args.every * args.checkpoints

    storage = Path(tempfile.mkdtemp(prefix="gpuyard-ckpt-bench-", dir=args.storage))
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    snapshots = shm / f"gpuyard-ckpt-bench-{os.getpid()}"
    os.environ[SNAPSHOT_DIR_ENV] = str(snapshots)
    dcp_shm = shm / f"gpuyard-ckpt-bench-dcp-{os.getpid()}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1")}
    try:
        run_dir = storage / "run"
        res = measure(args, run_dir, dcp_shm)
        shutil.rmtree(dcp_shm, ignore_errors=True)
        from_memory, restart_memory = restart(args, run_dir, env)
        shutil.rmtree(snapshots, ignore_errors=True)
        evicted = evict_page_cache(run_dir)
        from_storage, restart_storage = restart(args, run_dir, env)
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
        shutil.rmtree(dcp_shm, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    assert from_memory["source"] == "memory", from_memory
    assert from_storage["source"] == "storage", from_storage
    report(args, res, from_memory, from_storage, restart_memory, restart_storage, evicted)


def evict_page_cache(folder: Path) -> str:
    """Make the next read of ``folder``'s files come from the disk; returns how.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file (written and fsynced, so its pages are clean
    and are dropped): only these files leave the page cache, not the whole machine's, which other
    work on a shared machine would feel. Python, torch and the libraries stay cached, as they would
    for a restarted rank on a real node.
    """
    count = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return f"posix_fadvise DONTNEED on {count} files"


def report(
    args: argparse.Namespace,
    res: dict[str, Any],
    from_memory: dict[str, Any],
    from_storage: dict[str, Any],
    restart_memory: float,
    restart_storage: float,
    evicted: str,
) -> None:
    # Steady state: each kind's first checkpoint of the run is reported apart (its first allocations).
    stall = {kind: statistics.median(res[kind][1:] or res[kind]) for kind in KINDS}
    first = {kind: res[kind][0] for kind in KINDS}
    step = statistics.median(t for _, t in res["steps"])
    times = dict(res["steps"])

    # The steps after a checkpoint run beside its background work (copies, serialisation, writes; on
    # 2 cores here they slow down): their extra time over the median step, up to the next
    # checkpoint, is a cost the stall does not show. Whole cost = stall + that extra, per kind.
    def extra(steps: list[int]) -> float:
        return statistics.median(
            sum(max(0.0, times.get(s + i, step) - step) for i in range(1, args.every)) for s in steps
        )

    slow = {kind: extra(res[f"{kind}_steps"][1:] or res[f"{kind}_steps"]) for kind in KINDS}
    cost = {kind: stall[kind] + slow[kind] for kind in KINDS}
    # The competitor is async DCP in whichever configuration did better in this run; for the whole
    # cost, writing into /dev/shm as the snapshot does (the disk figure beside).
    best_stall = min(ASYNC_KINDS, key=lambda k: stall[k])
    best_cost = min(("async_shm", "async_staged_shm"), key=lambda k: cost[k])
    best_cost_disk = min(("async", "async_staged"), key=lambda k: cost[k])
    print(
        f"state {res['state_mb']:.0f} MiB (model {res['params'] / 1e6:.1f} M params + AdamW), "
        f"step {step * 1e3:.0f} ms, {args.checkpoints} checkpoints every {args.every} steps, the kinds "
        f"in turn ({', '.join(KINDS)}); stall and cost: medians without each kind's first"
    )
    for kind in KINDS:
        all_ms = ", ".join(f"{x * 1e3:.1f}" for x in res[kind])
        waits = res.get(f"{kind}_wait")
        of_which = (
            f"; of which waiting before the next update: {', '.join(f'{w * 1e3:.1f}' for w in waits)}"
            if waits
            else ""
        )
        print(
            f"{kind:>16}: stall {stall[kind] * 1e3:8.1f} ms, first {first[kind] * 1e3:.1f} ms "
            f"(all: {all_ms}{of_which}); slower steps after it "
            f"{slow[kind] * 1e3:.0f} ms; whole cost {cost[kind] * 1e3:.0f} ms"
        )
    print(
        f"snapshot background work (copy into the mapped /dev/shm file, off the training thread): "
        f"{statistics.median(res['background'] or [0.0]):.2f} s; data files allocated ahead "
        f"(once, in the background): {res['prepare_s']:.2f} s"
    )
    print(
        f"recovery: from memory {from_memory['seconds']:.3f} s (step {from_memory['step']}), "
        f"from storage {from_storage['seconds']:.3f} s (step {from_storage['step']}; page cache: {evicted}); "
        f"new process to resumed: {restart_memory:.1f} s / {restart_storage:.1f} s"
    )
    print(
        f"  of which SHA-256 checks: memory {from_memory.get('memory_verify_s', 0.0):.3f} s (inside its "
        f"time), storage {from_storage.get('storage_verify_s', 0.0):.3f} s "
        "(before its timer, not in its time)"
    )
    mem = stall["memory"]
    print(
        f"checkpoint: stall_ratio_vs_async={stall[best_stall] / mem:.1f} "
        f"cost_ratio_vs_async={cost[best_cost] / cost['memory']:.2f} "
        f"cost_ratio_vs_async_disk={cost[best_cost_disk] / cost['memory']:.2f} "
        f"first_stall_ratio_vs_async={first[best_stall] / first['memory']:.2f} "
        f"stall_ratio_vs_sync={stall['sync'] / mem:.1f} "
        f"cost_ratio_vs_sync={cost['sync'] / cost['memory']:.2f} "
        f"best_async_stall={best_stall} best_async_cost={best_cost} best_async_cost_disk={best_cost_disk} "
        f"recovery_memory_s={from_memory['seconds']:.3f} "
        f"recovery_storage_cold_s={from_storage['seconds']:.3f} "
        f"memory_verify_s={from_memory.get('memory_verify_s', 0.0):.3f} "
        f"storage_verify_s={from_storage.get('storage_verify_s', 0.0):.3f} "
        f"restart_s={restart_memory:.1f} memory_stall_ms={mem * 1e3:.1f} "
        f"memory_first_stall_ms={first['memory'] * 1e3:.1f} memory_prepare_s={res['prepare_s']:.2f} "
        f"{best_stall}_first_stall_ms={first[best_stall] * 1e3:.1f} "
        f"async_stall_ms={stall['async'] * 1e3:.1f} async_staged_stall_ms={stall['async_staged'] * 1e3:.1f} "
        f"sync_stall_ms={stall['sync'] * 1e3:.0f} memory_cost_ms={cost['memory'] * 1e3:.0f} "
        + " ".join(f"{k}_stall_ms={stall[k] * 1e3:.1f}" for k in ("async_shm", "async_staged_shm"))
        + f" async_cost_ms={cost['async'] * 1e3:.0f} async_staged_cost_ms={cost['async_staged'] * 1e3:.0f} "
        + " ".join(f"{k}_cost_ms={cost[k] * 1e3:.0f}" for k in ("async_shm", "async_staged_shm"))
        + f" snapshots={len(res['memory'])} "
        f"state_mib={res['state_mb']:.0f} load_avg={os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
