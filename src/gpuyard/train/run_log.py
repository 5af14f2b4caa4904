"""What the trainer records: its tracker, the per-step metrics line, the progress line, status.json.

Rank 0 records where ``spec.tracking`` says: ``metrics.jsonl`` in the run folder (each step's line
written before the next step starts, so a killed run keeps every step it reported), plus a run in
the state store under ``tracking: db`` (:class:`gpuyard.tracking.training.DbRunTracker`, whose
database work is on a thread of its own). How the run ended goes to ``status.json``
(:mod:`gpuyard.train.status`) for the launcher.
"""

from __future__ import annotations

import os
from typing import Any

from gpuyard.errors import GpuyardError
from gpuyard.states import RunStatus
from gpuyard.tracking.files import JsonlTracker
from gpuyard.tracking.training import DbRunTracker, db_metric_key
from gpuyard.train.metrics import model_flops_utilization
from gpuyard.train.spec import TrainSpec
from gpuyard.train.status import TrainStatus, status_places, write_status
from gpuyard.train.trainer_state import TrainerState

__all__ = ["RunLog", "db_tracker", "tracked_dataset"]


def tracked_dataset(spec: TrainSpec) -> str | None:
    """``NAME@<version id>[#split=...]`` of the gpuyard dataset ``spec`` reads (``tracking.dataset``, or
    ``data.train``'s ``dataset`` argument): ``@latest`` resolved, a split selection kept, so the run's
    lineage names the rows read; an explicit reference the catalog does not know is kept as it is."""
    ref = spec.tracking.dataset
    explicit = ref is not None
    if ref is None and spec.data.train is not None:
        candidate = spec.data.train.kwargs.get("dataset")
        ref = candidate if isinstance(candidate, str) else None
    if ref is None:
        return None
    from gpuyard.data.arrays import pin  # pyarrow: only for a run that reads a dataset (0.4 s)

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


class RunLog(TrainerState):
    """The trainer's records: the database run, each step's metrics, the progress line, status.json."""

    _run_params: dict[str, Any]
    _unlogged: list[float]  # step seconds, data wait, straggler wait since the last logged line

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

    def _log_step(self, loss: float, samples: int, tokens: int, seconds: float) -> None:
        """Each step's metrics: into ``last_metrics``, and to the tracker on a ``log_every_steps`` step."""
        dp = self.ctx.layout.dp
        metrics: dict[str, float] = {
            "loss": loss,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "step_time": seconds,
            "samples_per_s": samples * dp / seconds if seconds > 0 else 0.0,
            "tokens_per_s": tokens * dp / seconds if seconds > 0 else 0.0,
            "epoch": float(self.epoch),
        }
        if self._step_accuracy is not None:
            metrics["accuracy"] = self._step_accuracy  # beside the loss, classifiers only
        if self.last_grad_norm is not None:
            metrics["grad_norm"] = self.last_grad_norm
        acc, waits = self._unlogged, self._waits
        acc[0], acc[1], acc[2] = acc[0] + seconds, acc[1] + waits[0], acc[2] + waits[1]
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
        if self._step_accuracy is not None:
            info += f" accuracy {self._step_accuracy:.3f}"
        rate = self.last_metrics.get("samples_per_s")
        if rate:
            info += f" ({rate:,.0f} samples/s)"
        return info

    def _write_status(self, report: TrainStatus) -> None:
        """status.json in the run folder; where that fails (a full disk), in the launcher's private
        folder (``GPUYARD_TRAIN_STATUS_DIR``), where the launcher looks next."""
        write_status(report, status_places(self.run_dir))

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
