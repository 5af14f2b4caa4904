"""The training loop: accumulation, clipping, schedules, validation, early stopping, checkpoints, signals."""

from __future__ import annotations

import contextlib
import json
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

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.refs import import_ref
from gpuyard.states import RunStatus, TrainOutcome
from gpuyard.tracking.files import JsonlTracker, NullTracker, Tracker
from gpuyard.tracking.training import DbRunTracker, db_metric_key
from gpuyard.train import components as comp
from gpuyard.train.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    DiskFullError,
    gather,
    has_hashes,
    is_disk_full,
    latest_checkpoint,
    list_checkpoints,
    read_marker,
    set_aside,
    step_dirname,
    step_of,
    verify_checkpoint,
)
from gpuyard.train.data import (
    DataSource,
    call_factory,
    check_kwargs,
    count_batch,
    make_source,
    rank_batch_size,
    split_batch,
    to_device,
)
from gpuyard.train.elastic import adapt_rank_state
from gpuyard.train.goodput import step_waits
from gpuyard.train.memory_checkpoint import MemoryCheckpointer, default_snapshot_dir, fill, local_tensor
from gpuyard.train.metrics import DeviceStats, Progress, catalog_peak_tflops, model_flops_utilization
from gpuyard.train.names import STATUS_FALLBACK_ENV, STATUS_FILE
from gpuyard.train.parallel import (
    build_pipeline,
    clip_grad_norm,
    gradient_sync,
    init_distributed,
    parallelize,
)
from gpuyard.train.spec import TrainSpec
from gpuyard.train.step import apply_update, batch_loss, step_scale, token_weighted
from gpuyard.train.straggler import (
    CommTimer,
    SchedulerReporter,
    StepTimes,
    StragglerDetector,
    node_name,
)
from gpuyard.train.validation import (
    accuracy_counts,
    drive_pipeline,
    early_stopping_update,
    evaluate,
    is_classification,
)


@dataclass
class TrainResult:
    """How a run ended."""

    status: TrainOutcome
    step: int
    epoch: int
    run_dir: Path
    checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)


def tracked_dataset(spec: TrainSpec) -> str | None:
    """``NAME@<version id>[#split=...]`` of the gpuyard dataset ``spec`` reads (``tracking.dataset``, or
    ``data.train``'s ``dataset`` argument): ``@latest`` resolved, a split selection kept, so the run's
    lineage names the rows read; an explicit reference the catalog does not know is kept as it is."""
    from gpuyard.data.arrays import pin

    ref = spec.tracking.dataset
    explicit = ref is not None
    if ref is None and spec.data.train is not None:
        candidate = spec.data.train.kwargs.get("dataset")
        ref = candidate if isinstance(candidate, str) else None
    if ref is None:
        return None
    try:
        return pin(ref)
    except GpuyardError:  # not a catalog name after all (or a version or split this store lacks)
        return ref if explicit else None


def db_tracker(
    spec: TrainSpec,
    jsonl: JsonlTracker,
    *,
    start_step: int,
    resumed: bool,
    params: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
) -> DbRunTracker:
    """Rank 0's tracker under ``tracking: db``: the run's name, experiment, dataset and tags from ``spec``.

    Args:
        spec: the training spec. jsonl: rank 0's metrics.jsonl tracker.
        start_step: the step training starts from. resumed: whether it resumed from a checkpoint.
        params: settings recorded besides the spec. tags: labels (``spec.tracking.tags`` win).
    """
    return DbRunTracker(
        jsonl,
        name=spec.tracking.run_name or spec.name,
        experiment=spec.tracking.experiment or spec.name,
        start_step=start_step,
        resumed=resumed,
        dataset_version=lambda: tracked_dataset(spec),
        params=params,
        tags={**(tags or {}), **spec.tracking.tags},
    )


def save_error(exc: BaseException | None) -> CheckpointSaveError | None:
    """The CheckpointSaveError among `exc` and its causes (a background persist wraps it), or None."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, CheckpointSaveError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


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


class Trainer:
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
        self.batches_in_epoch = 0  # micro-batches consumed in the current epoch
        self.best: float | None = None
        self.bad_validations = 0
        self.last_metrics: dict[str, float] = {}
        self.stop_requested = False
        self.resumed_from: Path | None = None
        self.resumed_source: str | None = None  # storage | memory (in-memory snapshots, own or a peer's)
        self.memory: MemoryCheckpointer | None = None
        self.stragglers: StragglerDetector | None = None  # rank 0 of a multi-rank job
        self._reporter: SchedulerReporter | None = None  # rank 0: tells the job's scheduler
        self._comm_timer: CommTimer | None = None
        self._comm_wait = 0.0  # this step's wait in DDP's gradient all-reduce
        self._agree_wait = 0.0  # the previous step's wait in the loss agreement
        # Goodput (gpuyard.train.goodput): when this process built the trainer, and the data and
        # straggler waits (and step times) summed since the last logged metrics line.
        self._created = time.time()
        self._waits = (0.0, 0.0)  # this step's (data wait, straggler wait)
        self._unlogged = [0.0, 0.0, 0.0]  # step seconds, data wait, straggler wait

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
                default_snapshot_dir(self.run_dir), ctx.rank, ctx.world_size, self.checkpointer
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

    def _db_tracker(self) -> DbRunTracker:
        layout = self.ctx.layout
        params = {
            "layout": {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp},
            "world_size": self.ctx.world_size,
            "num_params": self.num_params,
            **self._run_params,
        }
        tags: dict[str, Any] = {}
        if os.environ.get("GPUYARD_JOB_ID"):  # a scheduler job: its goodput includes this run's
            tags["job_id"] = os.environ["GPUYARD_JOB_ID"]
        if self.val_source is not None:  # the objective `gpuyard runs ls` shows as validation/<metric>
            watched = self.spec.early_stopping.metric if self.spec.early_stopping else "val_loss"
            tags["metric"] = db_metric_key(watched).removeprefix("validation/")
        return db_tracker(
            self.spec,
            self.tracker,
            start_step=self.step,
            resumed=self.resumed_from is not None,
            params=params,
            tags=tags,
        )

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

    # ----- checkpoint state ---------------------------------------------------------------------
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
        self.scheduler.load_state_dict(state["scheduler"])
        comp.set_rng_state(state["rng"])
        self.train_source.load_state_dict(state["data"])

    # ----- events -------------------------------------------------------------------------------
    def _event(self, name: str, **fields: Any) -> None:
        log = getattr(self.tracker, "log_event", None)
        if log is not None:
            log(name, **fields)

    def _callback(self, event: str) -> None:
        for cb in self.callbacks:
            cb(self, event)

    def request_stop(self) -> None:
        """Ask the loop to checkpoint and stop at the next step boundary (what SIGTERM does)."""
        self.stop_requested = True

    # ----- one step -----------------------------------------------------------------------------
    def _autocast(self) -> Any:
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)

    def _train_step(self, micro: list[Any]) -> tuple[torch.Tensor, int, int]:
        """Forward, backward and update over `micro` batches; returns (loss, samples, tokens) of this rank."""
        d = self.spec.data
        total = torch.zeros((), device=self.ctx.device)
        samples = tokens = 0
        # [right predictions, counted labels] (one tensor: one device sync in _agree), batches not
        # classification
        self._counts: list[Any] = [None, 0]
        parts = [split_batch(batch, d.input_key, d.target_key) for batch in micro]
        # A token-weighted loss (lm_loss): each micro-batch's sum over the step's count on all dp
        # ranks, not a mean of means (packed batches count different numbers of labels).
        scale = None
        if self.pipeline is None and token_weighted(self.loss_fn):
            counts = [int(self.loss_fn.count(targets)) for _, targets in parts]  # type: ignore[attr-defined]
            dp = self.ctx.layout.dp
            scale = step_scale(counts, dp, self.ctx.group("dp") if dp > 1 else None, self.ctx.device)
        for i, (inputs, targets) in enumerate(parts):
            n, t = count_batch(inputs)
            samples, tokens = samples + n, tokens + t
            inputs, targets = to_device(inputs, self.ctx.device), to_device(targets, self.ctx.device)
            if self.pipeline is not None:
                total = total + self._pipeline_step(inputs, targets)
                continue
            with gradient_sync(self.model, i == len(micro) - 1), self._autocast():
                if scale is None:
                    loss = batch_loss(self.model, self._counting_loss, inputs, targets, parts=len(micro))
                else:
                    loss = self._counting_loss(self.model(inputs), targets, summed=True) * scale
            loss.backward()
            if self._comm_timer is not None and i == len(micro) - 1:
                self._comm_wait = self._comm_timer.wait_since_launch()
            total = loss.detach() if len(micro) == 1 else total + loss.detach()
        if self.spec.clip_grad_norm:
            self.last_grad_norm = clip_grad_norm(
                list(self.model.parameters()), self.spec.clip_grad_norm, self.ctx
            )
            if not math.isfinite(self.last_grad_norm):
                # A finite loss with inf/NaN gradients: do not let the update poison the weights;
                # report the step as diverged (the loss check below sees the NaN).
                self.optimizer.zero_grad(set_to_none=True)
                return torch.full((), float("nan"), device=self.ctx.device), samples, tokens
        if self.memory is not None:
            waited = self.memory.before_update()  # the last snapshot's copy of what the step changes
            if waited > 0.0005:
                self._event("memory_snapshot_wait", step=self.step, seconds=round(waited, 6))
        apply_update(self.optimizer, self.scheduler)
        return total, samples, tokens

    def _counting_loss(self, outputs: Any, targets: Any, summed: bool = False) -> torch.Tensor:
        """The loss, counting right predictions on the way when the task is classification (class
        scores against integer labels): the step's ``accuracy`` is logged beside its loss."""
        if is_classification(outputs, targets):
            pair = accuracy_counts(outputs, targets)
            self._counts[0] = pair if self._counts[0] is None else self._counts[0] + pair
        else:
            self._counts[1] += 1
        if summed:
            return self.loss_fn.total(outputs, targets)  # type: ignore[attr-defined]
        return self.loss_fn(outputs, targets)

    def _pipeline_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        if self.pipeline is None:
            raise RuntimeError("_pipeline_step without a pipeline")
        with self._autocast():
            losses = drive_pipeline(self.pipeline, inputs, targets, "step")
        if not losses:
            return torch.zeros((), device=self.ctx.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _agree(self, loss: torch.Tensor, data_s: float = 0.0, start: float = 0.0) -> tuple[float, bool, bool]:
        """One all-reduce: mean loss over loss-owning ranks, and whether any rank diverged or must stop.

        With straggler detection on, the same all-reduce carries every rank's step times (`data_s`
        waiting for batches; compute from `start`, after the batches, to the loss on the host,
        less the gradient all-reduce wait).
        """
        value = float(loss.item())  # one device sync per step: the loss is logged every step anyway
        self._waits = (data_s, 0.0)
        counts = getattr(self, "_counts", [None, 1])
        right, labels = (0.0, 0.0) if counts[0] is None else counts[0].tolist()
        other = float(counts[1])
        self._step_accuracy: float | None = None
        if self.ctx.world_size == 1:
            if labels and not other:
                self._step_accuracy = right / labels
            return value, not math.isfinite(value), self.stop_requested
        owner = 1.0 if self.ctx.is_loss_owner else 0.0
        bad = float(owner and not math.isfinite(value))
        stop = 1.0 if self.stop_requested else 0.0
        # Right predictions and labels of the loss owners (each sample counted once), summed.
        head = [0.0 if bad else value * owner, owner, bad, stop, right * owner, labels * owner, other * owner]
        timed = self.spec.straggler.enabled
        if timed:
            compute = max(0.0, time.perf_counter() - start - self._comm_wait)
            times = [0.0] * (3 * self.ctx.world_size)
            r = 3 * self.ctx.rank
            times[r : r + 3] = [data_s, compute, self._comm_wait + self._agree_wait]
            self._comm_wait = 0.0
            head += times
        vec = torch.tensor(head, device=self.ctx.device)
        began = time.perf_counter()
        dist.all_reduce(vec)
        self._agree_wait = time.perf_counter() - began
        values = vec.tolist()
        total, owners, any_bad, any_stop = values[:4]
        if values[5] and not values[6]:
            self._step_accuracy = values[4] / values[5]
        if timed and self.stragglers is not None:
            self._observe_times(values[7:])
        if timed and self.ctx.rank == 0:
            flat, s = values[7:], self.spec.straggler
            data = flat[0::3]
            own = [d + c for d, c in zip(data, flat[1::3], strict=True)]
            self._waits = step_waits(data, own, s.slowdown, s.min_seconds)
        return (float("nan") if any_bad else total / max(owners, 1.0)), bool(any_bad), bool(any_stop)

    def _observe_times(self, flat: list[float]) -> None:
        if self.stragglers is None:
            return
        times = [StepTimes(*flat[i : i + 3]) for i in range(0, len(flat), 3)]
        for found in self.stragglers.observe(self.step, times):
            self._event("straggler", **found.as_dict())
            print(f"gpuyard train: {found.message()}", file=sys.stderr, flush=True)
            if self._reporter is not None:
                self._reporter.report(found)

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

    def _log_step(self, loss: float, samples: int, tokens: int, seconds: float) -> None:
        dp = self.ctx.layout.dp
        metrics: dict[str, float] = {
            "loss": loss,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "step_time": seconds,
            "samples_per_s": samples * dp / seconds if seconds > 0 else 0.0,
            "tokens_per_s": tokens * dp / seconds if seconds > 0 else 0.0,
            "epoch": float(self.epoch),
        }
        if getattr(self, "_step_accuracy", None) is not None:
            metrics["accuracy"] = float(self._step_accuracy or 0.0)  # beside the loss, classifiers only
        if getattr(self, "last_grad_norm", None) is not None:
            metrics["grad_norm"] = self.last_grad_norm
        acc = self._unlogged
        acc[0], acc[1], acc[2] = acc[0] + seconds, acc[1] + self._waits[0], acc[2] + self._waits[1]
        metrics["data_wait_s"], metrics["straggler_wait_s"] = acc[1], acc[2]
        if self.spec.log_every_steps > 1:
            metrics["steps_time_s"] = acc[0]  # the steps since the last logged line (goodput)
        if self.peak_tflops and tokens:
            metrics["mfu"] = model_flops_utilization(
                self.num_params, metrics["tokens_per_s"], self.ctx.world_size, self.peak_tflops
            )
        metrics.update(self.device_stats.sample())
        self.last_metrics.update(metrics)
        if self.step % self.spec.log_every_steps == 0:
            self.tracker.log_metrics(self.step, metrics)
            self._unlogged = [0.0, 0.0, 0.0]

    def _progress_info(self, loss: float) -> str:
        """The loss, and for a classifier its accuracy on the step's batch, with the throughput."""
        info = f"loss {loss:.4f}"
        acc = getattr(self, "_step_accuracy", None)
        if acc is not None:
            info += f" accuracy {float(acc):.3f}"
        rate = self.last_metrics.get("samples_per_s")
        if rate:
            info += f" ({rate:,.0f} samples/s)"
        return info

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
                {
                    "run_id": getattr(self.tracker, "run_id", None),
                    "status": "failed",
                    "unrecoverable": True,
                    "error": error.reason,
                    "step": error.step,
                    "epoch": self.epoch,
                    "checkpoint": str(last) if last else None,
                }
            )

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

    def _write_status(self, doc: dict[str, Any]) -> None:
        """status.json in the run folder; where that fails (a full disk), in the launcher's private
        folder (``GPUYARD_TRAIN_STATUS_DIR``), where the launcher looks next."""
        text = json.dumps(doc)
        places = [self.run_dir]
        if os.environ.get(STATUS_FALLBACK_ENV):
            places.append(Path(os.environ[STATUS_FALLBACK_ENV]))
        for i, folder in enumerate(places):
            tmp = folder / f".{STATUS_FILE}.tmp"
            try:
                tmp.write_text(text)
                tmp.replace(folder / STATUS_FILE)
                return
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                if i == len(places) - 1:
                    raise

    def _tracker_failed(self, exc: BaseException) -> None:
        """Close the run as failed when an exception ends training (a restart may reopen it)."""
        fail = getattr(self.tracker, "fail", None)
        try:
            if fail is not None:
                fail(f"{type(exc).__name__}: {exc}"[:2000])
            else:
                self.tracker.finish(RunStatus.FAILED)
        except Exception:  # the training error is the one to report
            pass

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
            doc = {
                "run_id": getattr(self.tracker, "run_id", None),
                "tracking_failed": bool(getattr(self.tracker, "failed", False)),
                "status": status,
                "step": self.step,
                "epoch": self.epoch,
                "checkpoint": str(last) if last else None,
                "stragglers": [f.as_dict() for f in self.stragglers.found] if self.stragglers else [],
                "metrics": {k: v for k, v in self.last_metrics.items() if math.isfinite(v)},
            }
            self._write_status(doc)
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
