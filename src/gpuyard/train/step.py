"""One optimisation step, shared by the trainer's loop and model management's built-in MLP.

A step is: the loss of each (micro-)batch (:func:`batch_loss`), its backward pass, then one update
that applies the gradients and drops them (:func:`apply_update`). The trainer wraps the first in its
gradient-sync and autocast contexts and clips before the update; the built-in MLP calls both bare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def batch_loss(
    model: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    parts: int = 1,
) -> torch.Tensor:
    """The loss of one batch, as a share of a step that accumulates ``parts`` micro-batches.

    Args:
        model: the module (called on ``inputs``).
        loss_fn: ``loss_fn(prediction, targets)``.
        inputs: what the model takes.
        targets: what the loss compares with.
        parts: micro-batches accumulated into this step; the loss is divided by it (their mean).

    Returns:
        The loss tensor, not yet backpropagated.
    """
    loss = loss_fn(model(inputs), targets)
    if parts > 1:
        loss = loss / parts
    return loss


def apply_update(optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
    """Apply the accumulated gradients: the optimizer's step, the schedule's step, gradients set to None.

    Args:
        optimizer: holds the parameters and their gradients.
        scheduler: a learning-rate schedule stepped once per update, or None.
    """
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def token_weighted(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is a mean over counted items that differ in number from batch to batch
    (the labels of packed sequences): it then has ``total(outputs, targets)`` (the summed loss) and
    ``count(targets)`` (the items counted), and a step divides the sum by the count of the whole
    step, over its micro-batches and data-parallel ranks (:func:`step_scale`)."""
    return callable(getattr(loss_fn, "total", None)) and callable(getattr(loss_fn, "count", None))


def step_scale(counts: list[int], dp: int = 1, group: Any = None, device: Any = None) -> float:
    """The factor of each micro-batch's summed loss that makes a step the mean over all its items.

    Data parallelism averages gradients over ``dp`` ranks, so each rank scales its sums by
    ``dp / N`` (``N`` the items of the step over every rank, summed over ``group``; ``counts`` this
    rank's, one per micro-batch): the averaged gradient is then that of (sum over the step's items)
    / N, whatever the world size or the number of micro-batches, as on one rank with the same global
    batch. All ranks of ``group`` must call it. NaN when no item counts anywhere (as the mean of
    nothing is: the trainer reports the step as diverged).
    """
    total = sum(counts)
    if dp > 1:
        import torch.distributed as dist

        t = torch.tensor([float(total)], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        total = int(t.item())
    return dp / total if total > 0 else float("nan")
