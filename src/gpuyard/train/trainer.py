"""The training loop: set-up, epochs and steps, validation and early stopping, signals, how a run ends.

The trainer's other parts, one concept each: one step and the ranks' agreement on it
(:mod:`gpuyard.train.stepping`), checkpoints and resuming (:mod:`gpuyard.train.persistence`), what
it records (:mod:`gpuyard.train.run_log`), and the state they share (:mod:`gpuyard.train.trainer_state`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuyard.errors import ConfigError
from gpuyard.refs import import_ref
from gpuyard.states import TrainOutcome
from gpuyard.tracking.files import JsonlTracker, NullTracker, Tracker
from gpuyard.train import components as comp
from gpuyard.train.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    DiskFullError,
    is_disk_full,
    latest_checkpoint,
)
from gpuyard.train.data import DataSource, call_factory, check_kwargs, make_source, rank_batch_size
from gpuyard.train.memory_checkpoint import MemoryCheckpointer, default_snapshot_dir
from gpuyard.train.metrics import DeviceStats, Progress, catalog_peak_tflops
from gpuyard.train.parallel import build_pipeline, init_distributed, parallelize
from gpuyard.train.persistence import Persistence, save_error
from gpuyard.train.run_log import RunLog, db_tracker, tracked_dataset
from gpuyard.train.spec import TrainSpec
from gpuyard.train.status import TrainStatus
from gpuyard.train.stepping import Stepping
from gpuyard.train.straggler import CommTimer, SchedulerReporter, StragglerDetector, node_name
from gpuyard.train.validation import early_stopping_update, evaluate

# Set-up and tracking of a run, kept importable from here.
__all__ = ["TrainResult", "Trainer", "db_tracker", "pin_ddp_buckets", "tracked_dataset"]


@dataclass
class TrainResult:
    """How a run ended."""

    status: TrainOutcome
    step: int
    epoch: int
    run_dir: Path
    checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)


def pin_ddp_buckets(model: nn.Module) -> bool:
    """Give a DDP model whose gradients fit in one bucket its final bucket layout before the first step.

    DDP reduces the first iteration of every process in its initial layout (parameters in module
    order) and later ones in the layout rebuilt from the order gradients became ready (about the
    reverse). An all-reduce over 3 or more ranks sums each element in an order that depends on its
    place in the bucket, so a process that resumed did its first step with other rounding than the
    run it continues: not bit-exact. With one bucket there is no overlap to keep, so the layout is
    fixed at once (and never rebuilt). Returns whether it was; larger models are left to DDP.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if grads > getattr(model, "bucket_bytes_cap", 0):
        return False
    try:  # private Reducer calls (torch 2.x): where a version lacks them, DDP keeps its own layout
        model.reducer._push_all_rebuilt_params()
        return bool(model.reducer._rebuild_buckets())
    except (AttributeError, RuntimeError):
        return False


class Trainer(Stepping, Persistence, RunLog):
    """Runs one training job described by a TrainSpec, on one process or as one rank of many.

    Objects may be given directly (Python API) instead of the spec's entrypoints: `model` a factory
    or an nn.Module, `train_data`/`val_data` a map-style Dataset or a resumable loader. Without a
    `tracker`, rank 0 records where `spec.tracking` says (metrics.jsonl, plus a database run under
    `db`); `run_params` are recorded with the run besides the spec (e.g. the plan it follows).
    """

    def __init__(
        self,
        spec: TrainSpec,
        *,
        model: Any = None,
        train_data: Any = None,
        val_data: Any = None,
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
        tracker: Tracker | None = None,
        callbacks: list[Callable[[Trainer, str], None]] | None = None,
        run_params: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.run_dir = spec.resolved_run_dir()
        self._model_arg, self._train_arg, self._val_arg = model, train_data, val_data
        self.loss_fn = loss or comp.build_loss(spec.loss)
        self.callbacks = list(callbacks or []) + [import_ref(c, "callbacks") for c in spec.callbacks]
        self._tracker_arg = tracker
        self._run_params = dict(run_params or {})
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0
        self.best = None
        self.bad_validations = 0
        self.last_metrics = {}
        self.stop_requested = False
        self.resumed_from = None
        self.resumed_source = None
        self.memory = None
        self.stragglers = None
        self._reporter = None  # rank 0: tells the job's scheduler
        self._comm_timer = None
        self._comm_wait = 0.0
        self._agree_wait = 0.0
        self._counts = [None, 1]
        self._step_accuracy = None
        self.last_grad_norm = None
        # Goodput (gpuyard.train.goodput): when this process built the trainer, and the data and
        # straggler waits (and step times) summed since the last logged metrics line.
        self._created = time.time()
        self._waits = (0.0, 0.0)
        self._unlogged = [0.0, 0.0, 0.0]

    # ----- set-up -------------------------------------------------------------------------------
    def _build_model(self) -> nn.Module:
        arg = self._model_arg
        if arg is None:
            if self.spec.model is None:
                raise ConfigError("model: required (an entrypoint in the spec, or model= in the Python API)")
            arg = import_ref(self.spec.model.entrypoint, "model.entrypoint")
            built = arg(**check_kwargs(arg, self.spec.model.kwargs, "model"))
        else:
            built = arg if isinstance(arg, nn.Module) else arg()
        if not isinstance(built, nn.Module):
            raise ConfigError(f"model: the factory returned a {type(built).__name__}, not a torch.nn.Module")
        return built

    def _build_source(self, which: str) -> DataSource | None:
        arg = self._train_arg if which == "train" else self._val_arg
        entry = self.spec.data.train if which == "train" else self.spec.data.val
        ctx, d = self.ctx, self.spec.data
        train = which == "train"
        # With data.global_batch_size the per-rank batch follows the world size (elastic resume).
        batch, global_batch = rank_batch_size(
            d.batch_size, d.global_batch_size, ctx.layout.dp, self.spec.grad_accum
        )
        if arg is None:
            if entry is None:
                if which == "train":
                    raise ConfigError(
                        "data.train: required (an entrypoint, or train_data= in the Python API)"
                    )
                return None
            factory = import_ref(entry.entrypoint, f"data.{which}.entrypoint")
            # A loader factory's batch is the step's batch (train); validation batches may differ.
            arg = call_factory(
                factory, entry.kwargs, ctx.dp_rank, ctx.layout.dp, batch if train else None, f"data.{which}"
            )
        return make_source(
            arg,
            f"data.{which}",
            batch,
            ctx.dp_rank,
            ctx.layout.dp,
            shuffle=d.shuffle and train,
            seed=self.spec.seed,
            drop_last=d.drop_last or not train,
            num_workers=d.num_workers,
            global_batch=global_batch if train else None,
        )

    def setup(self) -> None:
        """Join the process group, build and parallelize the model, optimizer, data and checkpointer."""
        spec = self.spec
        self.ctx = ctx = init_distributed(spec.parallel)
        if ctx.layout.pp > 1 and spec.grad_accum > 1:
            raise ConfigError(
                "grad_accum: must be 1 with pipeline parallel; raise parallel.microbatches instead"
            )
        # Same seed on every rank so replicas (and tensor-parallel shards) start from one model.
        comp.seed_everything(spec.seed)
        full = self._build_model()
        self.num_params = comp.count_parameters(full)  # before sharding: the whole model
        self.pipeline = None
        if ctx.layout.pp > 1:
            self.pipeline = build_pipeline(full, ctx, spec.parallel, self.loss_fn)
            self.model = self.pipeline.module
        else:
            self.model = parallelize(full, ctx, spec.parallel)
            pin_ddp_buckets(self.model)
            if spec.compile:
                self.model.compile()  # in place: parameter names (and checkpoints) stay the same
        # Different randomness per data shard (dropout), same within a tensor-parallel group.
        comp.seed_everything(spec.seed + 1000 * ctx.dp_rank + ctx.coord("pp"))
        self.optimizer = comp.build_optimizer(self.model.parameters(), spec.optimizer)
        train_source = self._build_source("train")
        if train_source is None:  # _build_source raises for missing training data; this keeps types exact
            raise ConfigError("data.train: required")
        self.train_source: DataSource = train_source
        self.val_source = self._build_source("val")
        self.total_steps = self._total_steps()
        self.scheduler = comp.build_scheduler(self.optimizer, spec.schedule, self.total_steps)
        self.use_bf16 = spec.precision == "bf16" or (spec.precision == "auto" and ctx.device.type == "cuda")
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", spec.checkpoint.keep, ctx.rank, spec.checkpoint.async_save
        )
        if spec.checkpoint.memory_every:
            self.memory = MemoryCheckpointer(
                default_snapshot_dir(self.run_dir),
                ctx.rank,
                ctx.world_size,
                self.checkpointer,
                state=self._app_state,  # its data files are allocated ahead of the first snapshot
            )
        main = ctx.rank == 0
        if self._tracker_arg is not None:
            self.tracker: Any = self._tracker_arg if main else NullTracker()
        else:
            self.tracker = JsonlTracker(self.run_dir) if main else NullTracker()
        self.device_stats = DeviceStats(ctx.device)
        self.peak_tflops = spec.peak_tflops or catalog_peak_tflops(
            ctx.device, "bf16" if self.use_bf16 else "fp32"
        )
        if spec.checkpoint.resume:
            self._resume()
        self._setup_stragglers()
        if main and self._tracker_arg is None and spec.tracking.backend == "db":
            # After resuming: the database run continues from the checkpoint's step.
            self.tracker = self._db_tracker()

    def _setup_stragglers(self) -> None:
        s = self.spec.straggler
        if not s.enabled or self.ctx.world_size == 1:
            return
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.model, DistributedDataParallel):
            self._comm_timer = CommTimer()
            self.model.register_comm_hook(self.ctx.group("dp"), self._comm_timer.hook)
        # Every rank's node, once (a scheduler restarting the job without a straggler's node needs it).
        nodes: list[Any] = [None] * self.ctx.world_size
        torch.distributed.all_gather_object(nodes, node_name())
        if self.ctx.rank == 0:
            self.stragglers = StragglerDetector(
                self.ctx.world_size, s.window, s.min_fraction, s.slowdown, s.min_seconds
            )
            self._reporter = SchedulerReporter([str(n) for n in nodes])

    def _total_steps(self) -> int:
        if self.spec.max_steps:
            return self.spec.max_steps
        source = self.train_source
        per_epoch = (
            len(source.loader) if hasattr(source, "loader") and hasattr(source.loader, "__len__") else 0
        )
        if not per_epoch:  # a loader without a length: schedules need max_steps
            return max(1, self.spec.max_steps or 1)
        return max(1, per_epoch // self.spec.grad_accum * self.spec.epochs)

    # ----- validation ---------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Mean loss over the validation data (all data-parallel shards); {} without validation data."""
        if self.val_source is None:
            return {}
        keys = (self.spec.data.input_key, self.spec.data.target_key)
        return evaluate(
            self.model, self.val_source, self.loss_fn, self.ctx, self.pipeline, self._autocast, keys
        )

    def _after_validation(self, metrics: dict[str, float]) -> bool:
        """Record validation metrics; True when early stopping says stop."""
        if not metrics:
            return False
        self.tracker.log_metrics(self.step, metrics)
        self.last_metrics.update(metrics)
        self._callback("validation")
        self.best, self.bad_validations, stop = early_stopping_update(
            self.spec.early_stopping, metrics, self.best, self.bad_validations
        )
        return stop

    # ----- the loop -----------------------------------------------------------------------------
    def _install_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: Any) -> None:
            self.stop_requested = True  # acted on at the next step boundary, agreed by all ranks

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _next_micro(self, it: Any) -> list[Any] | None:
        micro = []
        for _ in range(self.spec.grad_accum):
            try:
                micro.append(next(it))
            except StopIteration:
                return None  # epoch over; a partial accumulation is dropped, consistently on resume
            self.batches_in_epoch += 1
        return micro

    def _run_epoch(self, progress: Progress) -> TrainOutcome | None:
        """Train until the epoch ends; returns a stop status, or None to continue."""
        spec = self.spec
        if self.batches_in_epoch == 0:
            self.train_source.set_epoch(self.epoch)
        it = iter(self.train_source)
        tick = time.perf_counter()
        while True:
            fetch = time.perf_counter()
            micro = self._next_micro(it)
            if micro is None:
                return None
            fetched = time.perf_counter()
            loss_t, samples, tokens = self._train_step(micro)
            self.step += 1
            loss, diverged, stop = self._agree(loss_t, fetched - fetch, fetched)
            now = time.perf_counter()
            if diverged:
                return TrainOutcome.DIVERGED
            self._log_step(loss, samples, tokens, now - tick)
            if progress.due():  # the line is built only when shown (every 10 s in a job's log)
                progress.update(self.step, self._progress_info(loss))
            self._callback("step")
            tick = now
            if spec.checkpoint.every_steps and self.step % spec.checkpoint.every_steps == 0:
                self.save_checkpoint("every_steps")
            if spec.checkpoint.memory_every and self.step % spec.checkpoint.memory_every == 0:
                self.snapshot()
            if (
                spec.val_every_steps
                and self.step % spec.val_every_steps == 0
                and self._after_validation(self.validate())
            ):
                return TrainOutcome.EARLY_STOPPED
            if spec.max_steps and self.step >= spec.max_steps:
                return TrainOutcome.COMPLETED
            if stop:
                return TrainOutcome.PREEMPTED
            tick = time.perf_counter()  # checkpoint and validation time is not step time

    def fit(self) -> TrainResult:
        """Train to the end (or until stopped); every rank calls it. Returns how the run ended."""
        self.setup()
        spec = self.spec
        previous = self._install_sigterm()
        if self.ctx.rank == 0:
            self.tracker.log_params(spec.model_dump(mode="json"))
        self._event(
            "attempt",
            started=round(self._created, 3),
            step=self.step,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            world_size=self.ctx.world_size,
        )
        tty = sys.stdout.isatty()
        progress = Progress(self.total_steps, enabled=self.ctx.rank == 0 and tty, lines=self.ctx.rank == 0)
        progress.update(self.step, "")
        status = TrainOutcome.COMPLETED
        try:
            try:
                status = self._loop(progress)
            except BaseException as exc:
                self._save_failed_event(save_error(exc))
                self._tracker_failed(exc)
                raise
            finally:
                progress.close()
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
            return self._finish(status)
        except BaseException as exc:
            error: CheckpointSaveError | DiskFullError | None = save_error(exc)
            if error is None and isinstance(exc, OSError) and is_disk_full(exc, self.run_dir):
                # metrics.jsonl, tracking or status files on a full disk (rank 0 writes them)
                error = DiskFullError(self.step, str(exc.filename or self.run_dir))
            if error is not None and error.disk_full:
                self._end_unrecoverable(error)
                raise error from exc
            raise

    def _end_unrecoverable(self, error: CheckpointSaveError | DiskFullError) -> None:
        """A failure a restart would repeat (the disk is full): close the run as failed and say so in
        status.json, so the launcher stops instead of letting torchrun restart into it again."""
        self._save_failed_event(error)
        self._tracker_failed(error)
        if self.ctx.rank == 0:
            last = latest_checkpoint(self.checkpointer.root)
            self._write_status(
                TrainStatus(
                    TrainOutcome.FAILED,
                    run_id=getattr(self.tracker, "run_id", None),
                    unrecoverable=True,
                    error=error.reason,
                    step=error.step,
                    epoch=self.epoch,
                    checkpoint=str(last) if last else None,
                )
            )

    def _loop(self, progress: Progress) -> TrainOutcome:
        spec = self.spec
        if spec.max_steps and self.step >= spec.max_steps:
            return TrainOutcome.COMPLETED
        while self.epoch < spec.epochs:
            status = self._run_epoch(progress)
            if status is TrainOutcome.DIVERGED:
                return status
            if status is None:  # the epoch ended
                self.epoch += 1
                self.batches_in_epoch = 0
                stop_early = not spec.val_every_steps and self._after_validation(self.validate())
                if spec.checkpoint.at_epoch_end or stop_early:
                    self.save_checkpoint("epoch_end")
                if stop_early:
                    return TrainOutcome.EARLY_STOPPED
                if self.stop_requested:
                    return TrainOutcome.PREEMPTED
                continue
            if status is not TrainOutcome.COMPLETED:  # a completed run gets its final checkpoint in _finish
                self.save_checkpoint(status)
            return status
        return TrainOutcome.COMPLETED

    def _finish(self, status: TrainOutcome) -> TrainResult:
        if self.memory is not None:
            self.memory.wait()
            self._snapshot_warnings()
        self.checkpointer.wait()
        last = latest_checkpoint(self.checkpointer.root)
        at_last = last is not None and int(last.name.split("-")[1]) == self.step
        if status is TrainOutcome.COMPLETED and self.spec.checkpoint.final and not at_last:
            self.save_checkpoint("final")
            self.checkpointer.wait()
            last = latest_checkpoint(self.checkpointer.root)
        if status is TrainOutcome.DIVERGED:
            msg = (
                f"loss (or gradient norm) became non-finite at step {self.step}; stopped. "
                f"Last good checkpoint: {last or 'none'} (kept)"
            )
            self._event("diverged", step=self.step, checkpoint=str(last) if last else None)
            if self.ctx.rank == 0:
                print(f"gpuyard train: {msg}", file=sys.stderr, flush=True)
        self._callback("end")
        if self.ctx.rank == 0:
            # Before the tracker's finish, which may wait for a slow database: the launcher needs
            # this file even if the job is killed while waiting.
            self._write_status(
                TrainStatus(
                    status,
                    run_id=getattr(self.tracker, "run_id", None),
                    tracking_failed=bool(getattr(self.tracker, "failed", False)),
                    step=self.step,
                    epoch=self.epoch,
                    checkpoint=str(last) if last else None,
                    stragglers=[f.as_dict() for f in self.stragglers.found] if self.stragglers else [],
                    metrics={k: v for k, v in self.last_metrics.items() if math.isfinite(v)},
                )
            )
        self.tracker.finish(status)
        if self.ctx.world_size > 1:
            dist.barrier()
        if self.memory is not None:
            # The run ended on its own and wrote a storage checkpoint where it could resume: the
            # snapshots are no longer needed (every rank is past the barrier).
            self.memory.close()
        return TrainResult(status, self.step, self.epoch, self.run_dir, last, dict(self.last_metrics))

    def close(self) -> None:
        """Leave the process group (after fit)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
