"""Validation over all data-parallel shards, pipeline schedules driven per stage, and early stopping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.errors import ConfigError
from gpuyard.train.data import DataSource, count_batch, split_batch, to_device
from gpuyard.train.parallel import DistContext, Pipeline
from gpuyard.train.spec import EarlyStoppingSpec


def drive_pipeline(pipe: Pipeline, inputs: Any, targets: Any, method: str = "step") -> list[torch.Tensor]:
    """Run one batch through this rank's stage with the schedule's `step` (train) or `eval`.

    The first stage feeds inputs, the last feeds targets and collects one loss per micro-batch;
    the returned list is empty on other stages.
    """
    run = getattr(pipe.schedule, method)
    losses: list[torch.Tensor] = []
    if pipe.is_first:
        run(inputs)
    elif pipe.is_last:
        run(target=targets, losses=losses)
    else:
        run()
    return losses


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    source: DataSource,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    ctx: DistContext,
    pipeline: Pipeline | None,
    autocast: Callable[[], Any],
    keys: tuple[str, str],
) -> dict[str, float]:
    """Mean loss over the whole validation data, summed over every data-parallel shard; and, for a
    classifier (class scores ``[..., C]`` against integer labels ``[...]``), ``val_accuracy``."""
    model.eval()
    # loss x samples, samples, correct predictions, labels, batches that were not classification
    total = torch.zeros(5, dtype=torch.float64)
    source.set_epoch(0)
    # A map-style source is read whole, from its DataLoader; a loader restarts on each iteration.
    batches = source.loader if hasattr(source, "sampler") else source
    outputs: Any = None
    for batch in batches:
        inputs, targets = split_batch(batch, *keys)
        inputs, targets = to_device(inputs, ctx.device), to_device(targets, ctx.device)
        n = count_batch(inputs)[0]
        with autocast():
            if pipeline is not None:
                losses = drive_pipeline(pipeline, inputs, targets, "eval")
                loss = torch.stack(losses).float().mean() if losses else torch.zeros(())
            else:
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
        if ctx.is_loss_owner:  # the last pipeline stage, tp index 0: each sample counted once
            right = labels = 0.0
            other = 1.0
            if pipeline is None and is_classification(outputs, targets):
                right, labels = accuracy_counts(outputs, targets).tolist()
                other = 0.0
            total += torch.tensor([float(loss) * n, n, right, labels, other], dtype=torch.float64)
    model.train()
    if ctx.world_size > 1:
        dev = total.to(ctx.device) if ctx.device.type == "cuda" else total
        dist.all_reduce(dev)
        total = dev.cpu()
    out = {"val_loss": float(total[0] / max(total[1].item(), 1.0))}
    if total[3] > 0 and total[4] == 0:
        out["val_accuracy"] = float(total[2] / total[3])
    return out


IGNORE_INDEX = -100  # F.cross_entropy's default: labels not predicted (padding, a packed document's end)


def accuracy_counts(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[right predictions, counted labels]`` (int64, on the outputs' device) of class scores
    ``[..., C]`` against integer labels ``[...]``; labels equal to ``IGNORE_INDEX`` are not counted.

    Five tensor operations (the trainer counts every step): a prediction is a class index, never
    ``IGNORE_INDEX``, so an ignored label is never a right prediction without masking it. ``argmax``
    records nothing for autograd (its output is an index), so the scores need no ``detach``."""
    pair = torch.stack([outputs.argmax(-1) == targets, targets != IGNORE_INDEX])
    return pair.sum(dim=tuple(range(1, pair.dim())))


def is_classification(outputs: Any, targets: Any) -> bool:
    """Class scores for integer labels: outputs ``[..., C]`` (C > 1), targets ``[...]``."""
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.dim() >= 2
        and outputs.shape[-1] > 1
        and not targets.is_floating_point()
        and not targets.is_complex()
        and targets.dtype != torch.bool
        and tuple(targets.shape) == tuple(outputs.shape[:-1])
    )


def early_stopping_update(
    spec: EarlyStoppingSpec | None, metrics: dict[str, float], best: float | None, bad: int
) -> tuple[float | None, int, bool]:
    """One validation's effect: returns the new (best, validations without improvement, stop?).

    Raises:
        ConfigError: when the watched metric is not among the validation metrics.
    """
    if spec is None:
        return best, bad, False
    if spec.metric not in metrics:
        raise ConfigError(f"early_stopping.metric: {spec.metric!r} is not one of {sorted(metrics)}")
    value = metrics[spec.metric]
    if spec.mode == "min":
        better = best is None or value < best - spec.min_delta
    else:
        better = best is None or value > best + spec.min_delta
    best, bad = (value, 0) if better else (best, bad + 1)
    return best, bad, bad >= spec.patience
