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
