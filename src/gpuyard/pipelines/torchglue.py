"""What a pipeline's DDP training job needs from gpuyard.data and gpuyard.models, as train-spec entrypoints.

- :func:`image_mlp`: model management's MLP (``gpuyard.models.builtin.mlp``) whose first layer
  standardises each pixel with the train split's mean and std (the "normalize" step, kept in the
  model so serving takes raw pixels);
- :func:`shard_batches`: the dataset version's split through ``gpuyard.data``'s ``ShardLoader``
  (disjoint rows per DDP rank, seeded augmentation, resumable position), as ``inputs``/``targets``;
- :func:`save_at_end`: a trainer callback that stores the trained module (safetensors + factory) in
  ``<run_dir>/model`` on rank 0, ready for evaluation and the registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gpuyard.data.views import LoaderView


def image_mlp(dataset: str, out_features: int, hidden: int = 64, activation: str = "relu", **kw: Any) -> Any:
    """The MLP over flattened images, standardised with statistics of ``dataset``'s train split."""
    from gpuyard.models.builtin import mlp
    from gpuyard.pipelines.arrays import split_arrays

    X, _ = split_arrays(dataset, "train")
    net = mlp(X.shape[1], out_features, hidden=hidden, activation=activation, **kw)
    mean, std = torch.as_tensor(X.mean(0)), torch.as_tensor(X.std(0))
    net[0].mean.copy_(mean)
    # Blank border pixels have std ~0: keep scale 1 there (as model management's trainer does).
    net[0].std.copy_(torch.where(std < 1e-3, torch.ones_like(std), std))
    return net


class _Flatten(LoaderView):
    """Wraps a ShardLoader: batches become ``{"inputs": float32 (B, F), "targets": int64 (B,)}``."""

    def __init__(self, loader: Any, column: str, label: str) -> None:
        super().__init__(loader)
        self.column, self.label = column, label

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            x = torch.as_tensor(np.asarray(batch[self.column]))
            y = torch.as_tensor(np.asarray(batch[self.label]))
            yield {"inputs": x.reshape(len(x), -1).float(), "targets": y.long()}


def shard_batches(
    dataset: str,
    split: str,
    batch_size: int,
    column: str = "image",
    label: str = "label",
    augment: bool = True,
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> _Flatten:
    """Batches of ``split`` for data-parallel rank ``dp_rank`` of ``dp_size`` (augmented when asked)."""
    from gpuyard.data.loader import LoaderConfig, ShardLoader

    cfg = LoaderConfig(
        batch_size=batch_size,
        split=split,
        columns=(column, label),
        augment=augment,
        seed=seed,
        drop_last=True,
    )
    return _Flatten(ShardLoader(dataset, cfg, rank=dp_rank, world_size=dp_size), column, label)


def save_at_end(trainer: Any, event: str) -> None:
    """Trainer callback: on ``end``, rank 0 saves the unwrapped module to ``<run_dir>/model``."""
    if event != "end" or trainer.ctx.rank != 0:
        return
    from gpuyard.models.flavors import save_model

    module = getattr(trainer.model, "module", trainer.model)  # DDP wraps the module
    save_model(module.eval(), trainer.run_dir / "model", "classification")
