"""The world sizes a training spec can run at with the same global batch (elastic jobs).

The scheduler (which does not import the training package) is given :func:`allowed_world_sizes` by
its front end (``gpuyard server``) to learn which sizes of an elastic job's range it may start it at.
"""

from __future__ import annotations

from pathlib import Path

from gpuyard.errors import ConfigError
from gpuyard.train.spec import load_spec


def allowed_world_sizes(path: str | Path, low: int, high: int, text: str | None = None) -> tuple[int, ...]:
    """The sizes from ``low`` to ``high`` at which the train spec at ``path`` (``text``: its text, read
    by the caller; None: read here) splits its
    ``data.global_batch_size`` evenly over its data-parallel ranks (with its ``parallel`` layout) and
    ``grad_accum``: the trainer's own checks, so the global batch, the sample order and the steps are
    the same at each of them.

    Raises:
        ConfigError: the spec is invalid, has no ``data.global_batch_size``, or no size in the range
            splits it (one line, naming the spec).
    """
    # Imported here: they import torch, which `gpuyard server` (the caller) need not load to start.
    from gpuyard.train.data import rank_batch_size
    from gpuyard.train.parallel import resolve_layout

    train = load_spec(path, text=text)
    global_batch = train.data.global_batch_size
    if global_batch is None:
        raise ConfigError(
            f"{path}: an elastic training job needs data.global_batch_size (instead of "
            "data.batch_size), so that its global batch and sample order stay the same at every size"
        )
    fits = []
    for size in range(low, high + 1):
        try:
            layout = resolve_layout(train.parallel, size)
            rank_batch_size(train.data.batch_size, global_batch, layout.dp, train.grad_accum)
        except ConfigError:
            continue
        fits.append(size)
    if not fits:
        raise ConfigError(
            f"resources.gpus: no size from {low} to {high} GPUs splits data.global_batch_size "
            f"{global_batch} of {path} evenly (over its parallel layout and grad_accum {train.grad_accum})"
        )
    return tuple(fits)
