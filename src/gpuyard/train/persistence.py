"""The trainer's checkpoints: what a checkpoint holds, saving it, in-memory snapshots, and resuming.

A checkpoint holds the model and optimizer (``_app_state``, sharded as the model is) and each rank's
own state (``_rank_state``: step, epoch, schedule, random generators, where the data is); resuming
loads the newest one whose files match their hashes (others are set aside), or a newer in-memory
snapshot (:mod:`gpuyard.train.memory_checkpoint`), adapted to a changed world size
(:mod:`gpuyard.train.elastic`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.errors import ConfigError
from gpuyard.train import components as comp
from gpuyard.train.checkpoint import (
    CheckpointSaveError,
    DiskFullError,
    gather,
    has_hashes,
    latest_checkpoint,
    list_checkpoints,
    optimizer_groups,
    read_marker,
    set_aside,
    step_dirname,
    step_of,
    verify_checkpoint,
)
from gpuyard.train.elastic import adapt_rank_state
from gpuyard.train.memory_checkpoint import fill, local_tensor
from gpuyard.train.trainer_state import TrainerState

__all__ = ["Persistence", "save_error"]


def save_error(exc: BaseException | None) -> CheckpointSaveError | None:
    """The CheckpointSaveError among `exc` and its causes (a background persist wraps it), or None."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, CheckpointSaveError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


class Persistence(TrainerState):
    """Checkpoints, in-memory snapshots and resuming, for the trainer."""

    def _app_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, self._optim_key: optim_sd}

    @property
    def _optim_key(self) -> str:
        # Optimizer param_groups are keyed by group index, so pipeline stages (different groups at the
        # same index) would overwrite each other in the checkpoint: give each stage a namespace.
        return "optim" if self.ctx.layout.pp == 1 else f"optim_stage{self.ctx.coord('pp')}"

    def _rank_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "best": self.best,
            "bad_validations": self.bad_validations,
            "scheduler": self.scheduler.state_dict(),
            "rng": comp.rng_state(),
            "data": self.train_source.state_dict(),
        }

    def _meta(self, reason: str) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "reason": reason,
            "world_size": self.ctx.world_size,
            "layout": [self.ctx.layout.pp, self.ctx.layout.dp, self.ctx.layout.tp],
        }

    def snapshot(self) -> float:
        """Take an in-memory snapshot of the current step (collective); returns the training stall
        in seconds. Persisted to storage in the background when the step is a ``persist_every`` one."""
        if self.memory is None:
            raise RuntimeError("snapshot: checkpoint.memory_every is 0")
        every = self.spec.checkpoint.persist_every
        persist = bool(every) and self.step % every == 0
        start = time.perf_counter()
        if persist:
            self.checkpointer.wait()  # an async storage save still pending: its finalize is collective
        self.memory.snapshot(
            self.step,
            self._app_state(),
            self._rank_state(),
            self._meta("persist_every"),
            persist,
            defer=self._update_only_tensors(),
        )
        total = time.perf_counter() - start
        self._event("memory_snapshot", step=self.step, stall_s=round(total, 6), persist=persist)
        self._snapshot_warnings()
        return total

    def _update_only_tensors(self) -> set[int]:
        """data_ptr() of the CPU tensors only the optimizer step changes (parameters and optimizer
        state): a snapshot copies them in the background while the next forward and backward run,
        and the next step waits for that copy (`before_update`). Buffers (BatchNorm statistics,
        which forward changes) are copied at once."""
        ptrs = {local_tensor(p).data_ptr() for p in self.model.parameters()}
        for state in self.optimizer.state.values():
            ptrs.update(local_tensor(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _snapshot_warnings(self) -> None:
        if self.memory is None:
            return
        while self.memory.warnings:
            msg = self.memory.warnings.pop(0)
            self._event("memory_snapshot_failed", message=msg)
            print(f"gpuyard train: warning: in-memory checkpoint: {msg}", file=sys.stderr, flush=True)

    def save_checkpoint(self, reason: str) -> Path:
        """Write a checkpoint of the current step on every rank (collective)."""
        if self.memory is not None:
            self.memory.wait()  # a background persist may be writing into the same folder
        last = latest_checkpoint(self.checkpointer.root)
        if last is not None and last.name == step_dirname(self.step):
            return last  # already saved at this step (e.g. every_steps, then the epoch end)
        began = time.perf_counter()
        path = self.checkpointer.save(self.step, self._app_state(), self._rank_state(), self._meta(reason))
        seconds = round(time.perf_counter() - began, 6)
        self._event("checkpoint", step=self.step, path=str(path), reason=reason, seconds=seconds)
        self._callback("checkpoint")
        return path

    def _resume(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = self._intact_checkpoint()
        if self.memory is not None:
            storage_step = -1 if path is None else step_of(path)
            restored = self.memory.restore(storage_step)
            self._snapshot_warnings()
            if restored is not None:
                start = time.perf_counter()
                app = fill(self._app_state(), restored.app)
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=app["model"],
                    optim_state_dict=app[self._optim_key],
                )
                self._set_rank_state(restored.rank_state)
                self.resumed_from = self.memory.holder_dir
                self.resumed_source = "memory"
                self._event(
                    "resume",
                    step=self.step,
                    epoch=self.epoch,
                    source="memory",
                    ranks={str(k): v for k, v in restored.sources.items()},
                    storage_step=storage_step,
                    seconds=round(restored.seconds + time.perf_counter() - start, 6),
                )
                return
        if path is None:
            return
        start = time.perf_counter()
        self._check_groups(path)
        app = self._app_state()
        state = self.checkpointer.load(path, app)
        meta, layout = read_marker(path), [self.ctx.layout.pp, self.ctx.layout.dp, self.ctx.layout.tp]
        state = adapt_rank_state(
            state,
            meta,
            world_size=self.ctx.world_size,
            layout=layout,
            seed=self.spec.seed,
            dp_rank=self.ctx.dp_rank,
            stage=self.ctx.coord("pp"),
            source=self.train_source,
        )
        set_state_dict(
            self.model, self.optimizer, model_state_dict=app["model"], optim_state_dict=app[self._optim_key]
        )
        self._set_rank_state(state)
        self.resumed_from = path
        self.resumed_source = "storage"
        self._event(
            "resume",
            step=self.step,
            epoch=self.epoch,
            path=str(path),
            source="storage",
            world_size=meta.get("world_size"),
            seconds=round(time.perf_counter() - start, 6),
        )

    def _check_groups(self, path: Path) -> None:
        """A checkpoint written with fewer optimizer groups than this run's optimizer has (weight decay
        turned on since: one group without it, decay and no-decay groups with it) cannot fill it: a
        configuration error in one line rather than DCP's missing-key traceback on every rank."""
        saved, now = optimizer_groups(path, self._optim_key), len(self.optimizer.param_groups)
        if saved is not None and saved < now:
            raise ConfigError(
                f"checkpoint {path} was written with {saved} optimizer parameter group(s) and this run's "
                f"optimizer has {now} (one without weight decay, decay and no-decay groups with it; "
                f"optimizer.weight_decay is {self.spec.optimizer.weight_decay:g} now): resume with the "
                "settings it was written with, or start a new run "
                "(checkpoint.resume: false, or another run_dir)"
            )

    def _intact_checkpoint(self) -> Path | None:
        """The newest complete checkpoint whose files match their hashes (collective: each rank
        checks a share of the files). Those that fail are set aside (renamed ``corrupt-*``, never
        deleted), with an event and a warning line; the one before is tried next."""
        rank, world = self.ctx.rank, self.ctx.world_size
        for path in reversed(list_checkpoints(self.checkpointer.root)):
            problems = [p for p in gather(verify_checkpoint(path, rank, world)) if p]
            if not problems:
                if rank == 0 and not has_hashes(path):
                    print(
                        f"gpuyard train: warning: {path} has no content hashes (written before they "
                        "were): loaded unverified",
                        file=sys.stderr,
                        flush=True,
                    )
                return path
            if rank == 0:
                aside = set_aside(path)
                self._event("checkpoint_set_aside", step=step_of(path), path=str(aside), reason=problems[0])
                print(
                    f"gpuyard train: warning: checkpoint of step {step_of(path)} failed its check "
                    f"({problems[0]}): set aside as {aside.name}; trying the one before",
                    file=sys.stderr,
                    flush=True,
                )
            if world > 1:
                dist.barrier()  # renamed before any rank lists again
        return None

    def _set_rank_state(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.best, self.bad_validations = state["best"], int(state["bad_validations"])
        groups = len(self.optimizer.param_groups)
        self.scheduler.load_state_dict(comp.scheduler_state_for(state["scheduler"], groups))
        comp.set_rng_state(state["rng"])
        self.train_source.load_state_dict(state["data"])

    def _save_failed_event(self, error: CheckpointSaveError | DiskFullError | None) -> None:
        if error is None or getattr(self, "_save_failure_logged", False):
            return
        self._save_failure_logged = True
        with contextlib.suppress(OSError, ValueError):  # metrics.jsonl may be on the full disk
            self._event(
                "checkpoint_failed",
                step=error.step,
                path=error.path,
                reason=error.reason,
                disk_full=error.disk_full,
            )
