"""Resumable data sources: the data position (epoch, batch index) for map-style datasets and loaders.

Two kinds of training data are accepted:

* a map-style ``torch.utils.data.Dataset`` (``__getitem__`` + ``__len__``): gpuyard owns the order
  through :class:`ResumableSampler`, a ``DistributedSampler`` that can start part-way into an epoch,
  or, with ``data.global_batch_size``, :class:`GlobalBatchSampler`, whose order and global batches
  do not depend on the world size (a run can resume at another world size);
* any iterable loader with ``state_dict()`` / ``load_state_dict()`` (and optionally
  ``set_epoch(epoch)``): the loader owns its position, gpuyard saves and restores it per rank. With
  ``data.global_batch_size`` the loader must also have ``set_global_batch(global_batch, dp_rank,
  dp_size)`` (gpuyard.data's ``ShardLoader`` has): it then takes this rank's slice of global batches
  and its position is global, so the run can resume at another world size too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

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


class GlobalBatchSampler(Sampler[int]):
    """This rank's slice of each global batch of an epoch order that does not depend on the world size.

    An epoch's order is a permutation of the dataset seeded by ``seed + epoch`` (the one
    ``DistributedSampler`` draws; the identity without shuffling), cut to a whole number of global
    batches of ``global_batch`` samples: the tail is dropped (``drop_last``) or filled by wrapping
    around to the start of the order, as ``DistributedSampler`` pads to the world size. Global batch
    k is ``order[k * global_batch : (k + 1) * global_batch]``; data-parallel rank r takes its r-th
    contiguous slice of ``global_batch // dp_size`` samples. So the samples of every step, and the
    position after k batches, are the same at any world size that divides the global batch.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        n = len(dataset)
        if global_batch % dp_size:
            raise ConfigError(
                f"data.global_batch_size: {global_batch} samples do not split evenly over {dp_size} "
                "data-parallel ranks"
            )
        if drop_last and n < global_batch:
            raise ConfigError(
                f"data: {n} samples is fewer than one global batch of {global_batch} (with drop_last)"
            )
        self.n, self.global_batch, self.dp_rank, self.dp_size = n, global_batch, dp_rank, dp_size
        self.per_rank = global_batch // dp_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0  # this rank's samples to skip in the next iteration

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in an epoch."""
        return self.n // self.global_batch if self.drop_last else -(-self.n // self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order from the next iteration on."""
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        """Skip this rank's first `start` samples (whole batches: a multiple of its slice) next time."""
        self.start = start

    def epoch_order(self, epoch: int | None = None) -> torch.Tensor:
        """The global order of an epoch: every global batch, concatenated (world-size independent)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.n)
        total = self.batches_per_epoch * self.global_batch
        if total <= self.n:
            return order[:total]
        reps = -(-total // self.n)
        return order.repeat(reps)[:total]

    def rank_indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's samples of an epoch, in order: its slice of each global batch."""
        batches = self.epoch_order(epoch).view(self.batches_per_epoch, self.global_batch)
        lo = self.dp_rank * self.per_rank
        return batches[:, lo : lo + self.per_rank].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        indices = self.rank_indices()[self.start :].tolist()
        self.start = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.batches_per_epoch * self.per_rank - self.start


class MapSource:
    """Batches from a map-style dataset, with position {epoch, batches_done} for exact resume.

    With `global_batch` (samples per micro-batch over all data-parallel ranks) the order comes from
    :class:`GlobalBatchSampler` and `batch_size` must be ``global_batch // dp_size``: the position,
    counted in global batches, then means the same samples at any world size.
    """

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
        global_batch: int | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.dp_size = dp_size
        self.global_batch = global_batch
        self.sampler: ResumableSampler | GlobalBatchSampler
        if global_batch is None:
            self.sampler = ResumableSampler(dataset, dp_size, dp_rank, shuffle, seed, drop_last)
        else:
            if batch_size * dp_size != global_batch:
                raise ValueError(f"batch_size {batch_size} x dp {dp_size} != global batch {global_batch}")
            self.sampler = GlobalBatchSampler(
                dataset, global_batch, dp_rank, dp_size, shuffle, seed, drop_last
            )
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

    def state_dict(self) -> dict[str, Any]:
        """Position: the epoch and how many batches of it this rank has consumed (each rank consumes
        one slice of every global batch, so it is also the number of global batches), and what the
        position means: the data-parallel size and per-rank batch, or the global batch."""
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "dp_size": self.dp_size,
            "batch_size": self.batch_size,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position.

        Raises:
            ConfigError: when the position would mean other samples here: another global batch, or
                another data-parallel size without ``data.global_batch_size`` (the per-rank order and
                the global batch of ``DistributedSampler`` change with the world size).
        """
        check_position(state, self.dp_size, self.batch_size, self.global_batch)
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self.batches_done = int(state["batches_done"])


def check_position(state: dict[str, Any], dp_size: int, batch_size: int, global_batch: int | None) -> None:
    """Refuse a saved map-style position that does not mean the same samples with these settings.

    States written before these keys existed carry only epoch and batches_done: accepted as before.

    Raises:
        ConfigError: one line naming the setting that differs.
    """
    if "dp_size" not in state:
        return
    saved_global, saved_dp = state.get("global_batch"), int(state["dp_size"])
    if saved_global is not None or global_batch is not None:
        if saved_global != global_batch:
            raise ConfigError(
                f"data.global_batch_size: the checkpoint was written with {saved_global}, this run has "
                f"{global_batch}; resuming exactly needs the same global batch (samples per micro-batch "
                "over all ranks)"
            )
        return
    if saved_dp != dp_size or int(state["batch_size"]) != batch_size:
        raise ConfigError(
            f"data.global_batch_size: the checkpoint was written at data-parallel size {saved_dp} "
            f"(batch {state['batch_size']} per rank), this run has {dp_size} (batch {batch_size}); "
            "to resume at another world size, train with data.global_batch_size set from the start"
        )


class LoaderSource:
    """A loader that keeps its own position (the `state_dict`/`load_state_dict` protocol).

    `global_batch` is set when the loader takes global batches (``set_global_batch``): its position
    then means the same samples at any data-parallel size dividing the global batch.
    """

    def __init__(self, loader: Any, global_batch: int | None = None) -> None:
        self.loader = loader
        self.global_batch = global_batch

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


def check_loader_position(state: dict[str, Any], global_batch: int | None) -> None:
    """Refuse a saved loader position in global-batch mode that this run's global batch cannot resume
    (the launcher's check, before workers start; the loader itself checks the rest).

    Raises:
        ConfigError: one line naming the setting that differs.
    """
    saved = state.get("global_batch_size")
    if saved is None:
        return
    if global_batch != saved:
        raise ConfigError(
            f"data.global_batch_size: the checkpoint's loader took global batches of {saved} samples per "
            f"micro-batch, this run has {global_batch}; resuming exactly needs the same global batch"
        )


def rank_batch_size(
    batch_size: int, global_batch_size: int | None, dp_size: int, grad_accum: int
) -> tuple[int, int | None]:
    """(samples per micro-batch on each data-parallel rank, samples per micro-batch over all ranks or
    None): `batch_size` per rank, or `global_batch_size` per optimizer step split over the
    data-parallel ranks and the accumulation steps.

    Raises:
        ConfigError: when the global batch does not split evenly.
    """
    if global_batch_size is None:
        return batch_size, None
    if global_batch_size % (dp_size * grad_accum):
        raise ConfigError(
            f"data.global_batch_size: {global_batch_size} is not divisible by data-parallel size "
            f"{dp_size} x grad_accum {grad_accum}"
        )
    return global_batch_size // (dp_size * grad_accum), global_batch_size // grad_accum


def is_resumable_loader(obj: Any) -> bool:
    """True for objects following the loader protocol (iterable + state_dict + load_state_dict)."""
    return all(callable(getattr(obj, name, None)) for name in ("__iter__", "state_dict", "load_state_dict"))


def call_factory(
    factory: Callable[..., Any],
    kwargs: dict[str, Any],
    dp_rank: int,
    dp_size: int,
    batch_size: int | None = None,
    field: str = "data.train",
) -> Any:
    """Call a dataset/loader factory, passing `dp_rank`/`dp_size` when its signature accepts them.

    A factory with a ``batch_size`` parameter makes its own batches: it gets `batch_size` (the
    trainer's per-rank batch) unless ``kwargs`` names one, so that ``data.batch_size`` is the batch
    the steps take, not the factory's default.

    Raises:
        ConfigError: ``kwargs`` names a ``batch_size`` other than `batch_size` (the spec would say
            one batch and the steps take another).
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    extra: dict[str, Any] = {}
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
        if key in params or accepts_any:
            extra[key] = value
    if batch_size is not None and "batch_size" in params:
        given = kwargs.get("batch_size", batch_size)
        if given != batch_size:
            raise ConfigError(
                f"{field}.kwargs.batch_size={given} but each rank's batch is {batch_size} (data.batch_size"
                " or data.global_batch_size): set one of them, or make them agree"
            )
        extra["batch_size"] = batch_size
    return factory(**check_kwargs(factory, {**extra, **kwargs}, field))


def check_kwargs(factory: Callable[..., Any], kwargs: dict[str, Any], field: str) -> dict[str, Any]:
    """``kwargs`` when ``factory`` accepts them, before it runs (a mistyped or missing argument is a
    configuration error, not a crash to restart into).

    Raises:
        ConfigError: naming ``field`` and what Python says of the call.
    """
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"{field}.kwargs: {exc} (the factory {getattr(factory, '__qualname__', factory)})"
        ) from None
    except ValueError:
        pass  # no signature to check (a builtin): the call itself will say
    return kwargs


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
    global_batch: int | None = None,
) -> DataSource:
    """Wrap what a data factory returned as a resumable source (`global_batch`: see MapSource).

    A loader given a `global_batch` is told its share through ``set_global_batch(global_batch,
    dp_rank, dp_size)``.

    Raises:
        ConfigError: for an iterable without a saveable position (exact resume would be impossible),
            or a global batch for a loader that cannot take one.
    """
    if is_resumable_loader(obj) and not (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")):
        if global_batch is None:
            return LoaderSource(obj)
        if not callable(getattr(obj, "set_global_batch", None)):
            raise ConfigError(
                f"{field}: data.global_batch_size needs a map-style Dataset or a loader with "
                "set_global_batch (gpuyard.data's ShardLoader); this loader sets its own batch"
            )
        obj.set_global_batch(global_batch, dp_rank, dp_size)
        return LoaderSource(obj, global_batch)
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        if len(obj) < dp_size:
            raise ConfigError(f"{field}: {len(obj)} samples is fewer than the {dp_size} data-parallel ranks")
        return MapSource(
            obj, batch_size, dp_rank, dp_size, shuffle, seed, drop_last, num_workers, global_batch
        )
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
    """(samples, tokens) in a batch; tokens count integer inputs (token ids), else 0.

    A mapping with ``input_ids`` (packed language-model batches) counts as its token ids.
    """
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
        inputs = inputs["input_ids"]
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
