"""The loader's settings (:class:`LoaderConfig`), the data-parallel topology it reads for, and the keys a
batch carries its position under (see :mod:`gpuyard.data.loader`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gpuyard.errors import ConfigError

POSITION_KEY = "_position"
SIZES_KEY = "_sizes"
Batch = dict[str, Any]


@dataclass(frozen=True)
class LoaderConfig:
    """How the loader reads a version.

    Attributes:
        batch_size: rows per batch.
        shuffle: shuffle shard order and rows within blocks (seeded); False keeps the stored order.
        shuffle_buffer: rows permuted together; larger mixes better and uses more memory.
        seed: base seed of shard order, permutations and augmentation.
        columns: columns to load (default: all).
        split: only rows of this split (``train``, ``val``, ...), from a recipe's split step.
        augment: apply the version's ``augment`` recipe step (turn off for evaluation).
        drop_last: drop each worker's last, partial batch.
        whole: "whole" mode, for versions that fit in memory: the columns are read and decoded once
            (the first epoch), and every epoch is one global seeded permutation of this rank's rows,
            each batch a gather from memory. No workers (``num_workers`` is ignored) and no
            ``shuffle_buffer``; memory holds the decoded columns. Batches differ from streaming
            mode's; a state saved in one mode is refused by the other.
        global_batch_size: global-batch mode: rows per batch over all data-parallel ranks, each rank
            taking its contiguous ``global_batch_size / world_size`` slice of every batch
            (``batch_size`` is then unused). The order and the saved position do not depend on the
            world size (or the worker count), so a state resumes at any world size dividing it.
    """

    batch_size: int = 256
    shuffle: bool = True
    shuffle_buffer: int = 16384
    seed: int = 0
    columns: tuple[str, ...] | None = None
    split: str | None = None
    augment: bool = True
    drop_last: bool = False
    whole: bool = False
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.shuffle_buffer < 1:
            raise ConfigError(
                f"batch_size and shuffle_buffer must be >= 1, got {self.batch_size}, {self.shuffle_buffer}"
            )
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {self.global_batch_size}")


def rank_share(global_batch: int, world_size: int) -> int:
    """Rows of each global batch that one of ``world_size`` ranks takes.

    Raises:
        ConfigError: the world size does not divide the global batch.
    """
    if global_batch % world_size:
        raise ConfigError(
            f"global_batch_size {global_batch} does not split evenly over world size {world_size}; "
            "use a world size that divides it"
        )
    return global_batch // world_size


def topology(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit arguments, else torch.distributed when initialised, else the env."""
    if rank is not None and world_size is not None:
        found = (rank, world_size)
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        found = (torch.distributed.get_rank(), torch.distributed.get_world_size())
    else:
        found = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    if not 0 <= found[0] < found[1]:
        raise ConfigError(f"rank {found[0]} is outside world size {found[1]}")
    return found
