"""Resumable data sources: the data position (epoch, batch index) for map-style datasets and loaders.

Two kinds of training data are accepted:

* a map-style ``torch.utils.data.Dataset`` (``__getitem__`` + ``__len__``): gpuyard owns the order
  through :class:`ResumableSampler`, a ``DistributedSampler`` that can start part-way into an epoch;
* any iterable loader with ``state_dict()`` / ``load_state_dict()`` (and optionally
  ``set_epoch(epoch)``): the loader owns its position, gpuyard saves and restores it per rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from gpuyard.errors import ConfigError


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """A DistributedSampler (same shuffle, padding and rank striding) that can skip the first samples.

    ``set_start(n)`` makes the next iteration begin at this rank's n-th sample of the current epoch;
    the epoch after that starts at 0 again.
    """

    def __init__(
        self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int, drop_last: bool
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip this rank's first `start` samples in the next iteration."""
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.start :]
        self.start = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start


class MapSource:
    """Batches from a map-style dataset, with position {epoch, batches_done} for exact resume."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        num_workers: int = 0,
    ) -> None:
        self.batch_size = batch_size
        self.sampler = ResumableSampler(dataset, dp_size, dp_rank, shuffle, seed, drop_last)
        # A generator of its own: each new iterator draws a worker seed from it, and drawing from the
        # global RNG instead would shift dropout masks whenever an epoch is resumed part-way.
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            persistent_workers=False,
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.batches_done = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (its shuffle order depends on seed + epoch, as DistributedSampler's)."""
        if epoch != self.epoch:
            self.batches_done = 0
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_start(self.batches_done * self.batch_size)
        for batch in self.loader:
            self.batches_done += 1
            yield batch
        # A finished epoch: the next iteration of the same epoch would be empty; the trainer moves on.

    def state_dict(self) -> dict[str, int]:
        """Position: the epoch and how many batches of it this rank has consumed."""
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self.batches_done = int(state["batches_done"])


class LoaderSource:
    """A loader that keeps its own position (the `state_dict`/`load_state_dict` protocol)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        """Forward to the loader's set_epoch when it has one."""
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's own position."""
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Give the loader back its position."""
        self.loader.load_state_dict(state)


DataSource = MapSource | LoaderSource


def is_resumable_loader(obj: Any) -> bool:
    """True for objects following the loader protocol (iterable + state_dict + load_state_dict)."""
    return all(callable(getattr(obj, name, None)) for name in ("__iter__", "state_dict", "load_state_dict"))


def call_factory(factory: Callable[..., Any], kwargs: dict[str, Any], dp_rank: int, dp_size: int) -> Any:
    """Call a dataset/loader factory, passing `dp_rank`/`dp_size` when its signature accepts them."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    extra = {}
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
        if key in params or accepts_any:
            extra[key] = value
    return factory(**{**extra, **kwargs})


def make_source(
    obj: Any,
    field: str,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    num_workers: int = 0,
) -> DataSource:
    """Wrap what a data factory returned as a resumable source.

    Raises:
        ConfigError: for an iterable without a saveable position (exact resume would be impossible).
    """
    if is_resumable_loader(obj) and not (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")):
        return LoaderSource(obj)
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        if len(obj) < dp_size:
            raise ConfigError(f"{field}: {len(obj)} samples is fewer than the {dp_size} data-parallel ranks")
        return MapSource(obj, batch_size, dp_rank, dp_size, shuffle, seed, drop_last, num_workers)
    raise ConfigError(
        f"{field}: a {type(obj).__name__} has no resumable position; return a map-style Dataset "
        "(__getitem__ + __len__) or a loader with state_dict()/load_state_dict()"
    )


def split_batch(batch: Any, input_key: str, target_key: str) -> tuple[Any, Any]:
    """(inputs, targets) from a (x, y) sequence or a mapping with the configured keys.

    Raises:
        ConfigError: when the batch has neither shape.
    """
    if isinstance(batch, dict):
        if input_key not in batch or target_key not in batch:
            raise ConfigError(
                f"data.input_key/target_key: batch keys are {sorted(batch)}, "
                f"expected {input_key!r} and {target_key!r}"
            )
        return batch[input_key], batch[target_key]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError(f"data: a batch must be (inputs, targets) or a mapping, got {type(batch).__name__}")


def count_batch(inputs: Any) -> tuple[int, int]:
    """(samples, tokens) in a batch; tokens count integer inputs (token ids), else 0."""
    if isinstance(inputs, torch.Tensor):
        tokens = inputs.numel() if not inputs.is_floating_point() else 0
        return int(inputs.shape[0]) if inputs.dim() else 1, int(tokens)
    return 0, 0


def to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors (possibly nested in tuples, lists, dicts) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
