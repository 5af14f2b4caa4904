"""What the parts of the trainer share: its state during a run, its events and callbacks.

The trainer (:class:`gpuyard.train.trainer.Trainer`) is put together from parts, one concept each:
one optimizer step and the ranks' agreement on it (:mod:`gpuyard.train.stepping`), checkpoints,
snapshots and resuming (:mod:`gpuyard.train.persistence`), what it records (:mod:`gpuyard.train.run_log`),
and the set-up and loop in :mod:`gpuyard.train.trainer`. Each part derives from :class:`TrainerState`,
which declares the attributes they read and write (set by the trainer's ``__init__`` and ``setup``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuyard.train.checkpoint import Checkpointer
from gpuyard.train.data import DataSource
from gpuyard.train.memory_checkpoint import MemoryCheckpointer
from gpuyard.train.metrics import DeviceStats
from gpuyard.train.parallel import DistContext, Pipeline
from gpuyard.train.spec import TrainSpec
from gpuyard.train.straggler import CommTimer, SchedulerReporter, StragglerDetector


class TrainerState:
    """The trainer's state during a run; see the module's docstring."""

    spec: TrainSpec
    run_dir: Path
    ctx: DistContext
    model: nn.Module
    pipeline: Pipeline | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    train_source: DataSource
    val_source: DataSource | None
    checkpointer: Checkpointer
    memory: MemoryCheckpointer | None
    tracker: Any
    callbacks: list[Callable[[Any, str], None]]
    device_stats: DeviceStats
    use_bf16: bool
    num_params: int
    total_steps: int
    peak_tflops: float | None
    # Where the run is.
    step: int
    epoch: int
    batches_in_epoch: int  # micro-batches consumed in the current epoch
    best: float | None
    bad_validations: int
    last_metrics: dict[str, float]
    stop_requested: bool
    resumed_from: Path | None
    resumed_source: str | None  # storage | memory (in-memory snapshots, own or a peer's)
    # Straggler detection (rank 0 of a multi-rank job) and the waits it measures.
    stragglers: StragglerDetector | None
    _reporter: SchedulerReporter | None
    _comm_timer: CommTimer | None
    _comm_wait: float  # this step's wait in DDP's gradient all-reduce
    _agree_wait: float  # the previous step's wait in the loss agreement
    _waits: tuple[float, float]  # this step's (data wait, straggler wait)
    # This step's [right predictions, counted labels] (one tensor: one device sync), batches that
    # are not classification; its accuracy; the last clipped gradient norm.
    _counts: list[Any]
    _step_accuracy: float | None
    last_grad_norm: float | None

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

    def _autocast(self) -> Any:
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
