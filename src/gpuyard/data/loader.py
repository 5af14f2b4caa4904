"""The loader: a torch IterableDataset that streams a version's Parquet shards into training.

Each epoch, the shard order is shuffled (seeded by seed and epoch) and the rows, in that order, are cut
into one contiguous range per (rank, DataLoader worker): the ranges are disjoint, every rank gets the
same number of rows (up to ``world_size - 1`` rows per epoch are left out so DDP ranks stay in step),
and a worker only reads the row groups of its own range. Inside a range, blocks of
``shuffle_buffer`` rows are read (the next block in a background thread), permuted with a seeded
generator and cut into batches, so a batch costs a few NumPy slices and no per-sample Python.

Because blocks and permutations depend only on (seed, epoch, rank, worker, block), a position is just
"rows emitted so far" per worker: :class:`ShardLoader` records it from every batch, and a run resumed
from :meth:`ShardLoader.state_dict` yields exactly the batches the interrupted run would have.

That position is per rank, so it holds only at the world size it was saved at. Global-batch mode
(``LoaderConfig(global_batch_size=G)``) orders an epoch without reference to ranks: the rows in the
epoch's shard order, cut into blocks of ``shuffle_buffer`` rows, each permuted by (seed, epoch,
block), then cut into global batches of G rows (the tail dropped with ``drop_last``, else filled by
wrapping to the start of the order); rank r of W takes rows ``[r*G/W, (r+1)*G/W)`` of every global
batch. The position is then "global batches consumed", the same on every rank, and a state saved at
one world size resumes at any other that divides G with exactly the next unseen rows.

The parts: :mod:`~gpuyard.data.loader_config` (settings, topology), :mod:`~gpuyard.data.loader_reading`
(each consumer's rows, shard reading), :mod:`~gpuyard.data.loader_dataset` (the IterableDataset's
batches and shipments), :mod:`~gpuyard.data.loader_whole` (whole mode),
:mod:`~gpuyard.data.loader_threads` (thread workers); this module: :class:`ShardLoader`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader, default_convert

from gpuyard.data.cache import ShardCache
from gpuyard.data.dataset import DatasetVersion
from gpuyard.data.loader_config import POSITION_KEY, SIZES_KEY, Batch, LoaderConfig, rank_share, topology
from gpuyard.data.loader_dataset import ShardDataset
from gpuyard.data.loader_threads import iter_shipments
from gpuyard.errors import ConfigError

__all__ = ["LoaderConfig", "ShardDataset", "ShardLoader"]

# Rows a DataLoader worker sends per transfer: moving a tensor between processes has a fixed cost of
# about a millisecond, so workers ship several batches at once and the main process slices them apart.
SHIPMENT_ROWS = 8192
# "process": DataLoader worker processes; "thread": threads in this process (see loader_threads).
WORKER_MODES = ("process", "thread")


def _unpack(shipment: Batch) -> Iterator[tuple[Batch, int, int]]:
    """(batch, worker, position after it) for each batch of a shipment."""
    worker, end, _ = shipment.pop(POSITION_KEY).tolist()  # iterating the tensor costs ~20 us
    sizes = shipment.pop(SIZES_KEY, None)
    if sizes is None:
        yield shipment, worker, end
        return
    counts = sizes.tolist()
    start, pos = 0, end - sum(counts)
    for n in counts:
        pos += n
        yield {k: v[start : start + n] for k, v in shipment.items()}, worker, pos
        start += n


def _pinned(value: Any) -> Any:
    if isinstance(value, list):  # an object column converted by DataLoader's rules may hold tensors
        return [_pinned(v) for v in value]
    return value.pin_memory() if isinstance(value, torch.Tensor) else value


def _converted(batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches`` as DataLoader without workers hands them over (its ``default_convert``: NumPy
    arrays inside object columns become tensors), converting only the values that are not tensors."""
    for batch in batches:
        yield {k: v if isinstance(v, torch.Tensor) else default_convert(v) for k, v in batch.items()}


class ShardLoader:
    """A DataLoader over a :class:`ShardDataset` with a resumable position.

    ``for batch in loader`` yields dicts of tensors. ``state_dict()`` at any point, saved with a
    checkpoint and given to ``load_state_dict()`` of a new loader with the same settings, makes the
    new loader continue with exactly the batches the old one had not yet yielded.

    ``worker_mode="thread"`` runs the ``num_workers`` workers as threads of this process instead of
    DataLoader processes: the same batches in the same order (states carry over between modes), without
    the per-shipment cost of shared memory; faster for small samples on few cores (see docs/data.md).
    Process workers suit augmentation-heavy pipelines whose Python work would contend for the GIL.

    In global-batch mode (``LoaderConfig(global_batch_size=G)``, or :meth:`set_global_batch`) the
    state is the global position (global batches consumed, the same on every rank): it resumes at any
    world size that divides G, and with any worker count.
    """

    def __init__(
        self,
        dataset: DatasetVersion | str,
        config: LoaderConfig | None = None,
        *,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int = 2,
        cache: ShardCache | None = None,
        multiprocessing_context: str | None = None,
        persistent_workers: bool = False,
        worker_mode: str = "process",
    ) -> None:
        if worker_mode not in WORKER_MODES:
            raise ConfigError(f"worker_mode {worker_mode!r} unknown; use one of {', '.join(WORKER_MODES)}")
        self.worker_mode = worker_mode
        self.dataset = ShardDataset(dataset, config, rank=rank, world_size=world_size, cache=cache)
        self.num_workers = num_workers
        self.persistent_workers = persistent_workers and num_workers > 0
        self._loader: DataLoader[Batch] | None = None
        # Pinned host memory lets copies to the GPU run asynchronously; pointless without CUDA.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self._positions: dict[int, int] = {}
        self._next_worker = 0
        self._done = 0  # global-batch mode: global batches of this epoch consumed

    def set_global_batch(self, global_batch: int, rank: int, world_size: int) -> None:
        """Take global batches of ``global_batch`` rows, this rank's ``global_batch / world_size``
        slice of each (the trainer calls this for ``data.global_batch_size``).

        Raises:
            ConfigError: the world size does not divide the global batch, or the config already
                names another global batch size.
        """
        ds = self.dataset
        old = ds.config.global_batch_size
        if old is not None and old != global_batch:
            raise ConfigError(f"global_batch_size: this loader was made with {old}, asked for {global_batch}")
        rank_share(global_batch, world_size)
        topology(rank, world_size)
        ds.config = replace(ds.config, global_batch_size=global_batch)
        ds.rank, ds.world_size = rank, world_size

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (call before each epoch, as with DistributedSampler)."""
        self.dataset.set_epoch(epoch)
        self._positions, self._next_worker, self._done = {}, 0, 0

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        workers = max(1, self.num_workers)
        r, w = topology(self.dataset.rank, self.dataset.world_size)
        if self.dataset.config.global_batch_size is not None:
            rank_share(self.dataset.config.global_batch_size, w)
            return self.dataset.global_batch_count()
        bs, drop = self.dataset.config.batch_size, self.dataset.config.drop_last
        if self.dataset.config.whole:
            n = len(self.dataset.whole_rows(r, w))
            return n // bs if drop else -(-n // bs)
        sizes = [
            sum(len(x) for _, x in self.dataset.consumer_range(r, w, k, workers)) for k in range(workers)
        ]
        return sum(n // bs if drop else -(-n // bs) for n in sizes)

    def __iter__(self) -> Iterator[Batch]:
        ds = self.dataset
        # Resolved here, in the main process: DataLoader workers have no process group.
        ds.rank, ds.world_size = topology(ds.rank, ds.world_size)
        bs = ds.batch_rows  # refuses a world size that does not divide the global batch
        glob = ds.config.global_batch_size is not None
        if ds.config.whole:
            start = self._done * bs if glob else self._positions.get(0, 0)
            yield from self._whole_batches(ds.rank, ds.world_size, start, bs if glob else 0)
            return
        ds._rows_per_shard()  # read split membership once, before workers copy the dataset
        workers = max(1, self.num_workers)
        if glob:  # every worker starts from the rank's position; chunks are dealt from worker 0
            ds.start_positions = dict.fromkeys(range(workers), self._done * bs)
            ds.worker_offset = 0
        else:
            ds.start_positions = dict(self._positions)
            # DataLoader asks workers round-robin from worker 0; start the cycle at the worker that is due.
            ds.worker_offset = self._next_worker % workers
        ds.ship_batches = max(1, SHIPMENT_ROWS // bs) if self.num_workers else 1
        if glob and self.num_workers:
            # Whole blocks per shipment where the global batch allows it: a worker's shipment then
            # needs only its own blocks, and no block is decoded by two workers.
            g, size = ds.config.global_batch_size or 1, ds.config.shuffle_buffer
            aligned = math.lcm(g, size) // g  # global batches in a whole number of blocks
            if aligned <= 4 * ds.ship_batches:
                ds.ship_batches = -(-ds.ship_batches // aligned) * aligned
        span = ds.ship_batches * bs
        if self.worker_mode == "thread" and self.num_workers:
            shipments: Iterator[Batch] = iter_shipments(
                ds,
                ds.rank,
                ds.world_size,
                workers,
                ds.start_positions,
                ds.worker_offset,
                self.prefetch_factor,
            )
            yield from self._batches(shipments, span, workers, pin=self.pin_memory)
            return
        if not self.num_workers:
            # No workers: the dataset's generator itself. A DataLoader without workers would only add
            # its per-batch fetch, profiler hooks and conversion (a third of a small-sample epoch
            # here); its conversion is kept for what is not already a tensor, so batches are the same.
            yield from self._batches(_converted(iter(ds)), span, workers, pin=self.pin_memory)
            return
        if self.persistent_workers and ds._shared is None:
            ds._shared = torch.zeros(2 + workers, dtype=torch.int64).share_memory_()
        if ds._shared is not None:
            # Persistent workers keep their copy of the dataset: they read epoch and positions from here.
            ds._shared[0], ds._shared[1] = ds.epoch, ds.worker_offset
            ds._shared[2:] = torch.tensor([ds.start_positions.get(k, 0) for k in range(workers)])
        loader = (
            self._loader
            if self._loader is not None
            else DataLoader(
                ds,
                batch_size=None,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor if self.num_workers else None,
                multiprocessing_context=self.multiprocessing_context if self.num_workers else None,
                persistent_workers=self.persistent_workers,
            )
        )
        if self.persistent_workers:
            self._loader = loader
        yield from self._batches(iter(loader), span, workers)

    def _whole_batches(self, rank: int, world: int, start: int, per: int) -> Iterator[Batch]:
        """Whole mode's batches, recording the position for :meth:`state_dict` as :meth:`_batches`
        does (one worker; ``per``: the rank's share of a global batch, 0 outside global-batch mode)."""
        for batch, pos in self.dataset.whole_batches(rank, world, start):
            self._positions[0] = pos
            if per:
                self._done = pos // per
            yield {k: _pinned(v) for k, v in batch.items()} if self.pin_memory else batch
        self._positions, self._next_worker, self._done = {}, 0, 0
        self.dataset.start_positions, self.dataset.worker_offset = {}, 0

    def _batches(
        self, shipments: Iterator[Batch], span: int, workers: int, pin: bool = False
    ) -> Iterator[Batch]:
        """Batches of ``shipments``, recording each one's worker and position for :meth:`state_dict`."""
        per = self.dataset.batch_rows if self.dataset.config.global_batch_size is not None else 0
        for shipment in shipments:
            for batch, worker, pos in _unpack(shipment):
                self._positions[worker] = pos
                if per:  # global-batch mode: batches arrive in order, each one global batch's slice
                    self._done = pos // per
                # The next batch comes from this worker until its shipment is done, then from the next.
                self._next_worker = worker if pos % span else (worker + 1) % workers
                if pin:  # DataLoader pins in a thread of its own; batches without it are pinned here
                    batch = {k: _pinned(v) for k, v in batch.items()}
                yield batch
        self._positions, self._next_worker, self._done = {}, 0, 0
        self.dataset.start_positions, self.dataset.worker_offset = {}, 0

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch, per-worker rows emitted, and the settings they depend on.

        In global-batch mode: epoch and ``samples`` (global batches consumed x global batch), the same
        on every rank and meaningful at any world size dividing the global batch.
        """
        ds = self.dataset
        rank, world = topology(ds.rank, ds.world_size)
        g = ds.config.global_batch_size
        if g is not None:
            return {
                "dataset": ds.version.ref,
                "epoch": ds.epoch,
                "seed": ds.config.seed,
                "shuffle_buffer": ds.config.shuffle_buffer,
                "whole": ds.config.whole,
                "global_batch_size": g,
                "samples": self._done * g,
                "world_size": world,
            }
        return {
            "dataset": ds.version.ref,
            "epoch": ds.epoch,
            "seed": ds.config.seed,
            "batch_size": ds.config.batch_size,
            "shuffle_buffer": ds.config.shuffle_buffer,
            "num_workers": self.num_workers,
            "whole": ds.config.whole,
            "rank": rank,
            "world_size": world,
            "next_worker": self._next_worker,
            "positions": {str(k): v for k, v in sorted(self._positions.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a loader with the same dataset version and settings.

        A global-batch state resumes at any world size dividing its global batch and any worker count;
        a per-rank state only at the world size and worker count it was saved with.

        Raises:
            ConfigError: the state was taken with another version, seed, batch size, buffer, worker
                count or world size (the position would not mean the same rows), or in the other mode.
        """
        ds = self.dataset
        _, world = topology(ds.rank, ds.world_size)
        g, saved_g = ds.config.global_batch_size, state.get("global_batch_size")
        if g is not None and saved_g is None:
            raise ConfigError(
                f"loader state was saved in per-rank mode (world size {state.get('world_size')}), this "
                f"loader takes global batches of {g}: a per-rank position cannot be resumed as a global one"
            )
        if g is None and saved_g is not None:
            raise ConfigError(
                f"loader state was saved in global-batch mode (global_batch_size={saved_g}); resume it "
                f"with LoaderConfig(global_batch_size={saved_g})"
            )
        if g is not None:
            self._load_global(state, g, world)
            return
        if state.get("world_size") != world:
            raise ConfigError(
                f"loader state was saved in per-rank mode at world size {state.get('world_size')}, this "
                f"loader has world size {world}: a per-rank position cannot move to another world size "
                "(use global_batch_size, data.global_batch_size in a train spec, from the start)"
            )
        mine = {
            "dataset": ds.version.ref,
            "seed": ds.config.seed,
            "batch_size": ds.config.batch_size,
            "shuffle_buffer": ds.config.shuffle_buffer,
            "num_workers": self.num_workers,
            "whole": ds.config.whole,
            "world_size": world,
        }
        for key, value in mine.items():
            if state.get(key, False if key == "whole" else None) != value:
                raise ConfigError(f"loader state has {key}={state.get(key)!r}, this loader has {value!r}")
        ds.set_epoch(int(state["epoch"]))
        self._positions = {int(k): int(v) for k, v in state["positions"].items()}
        self._next_worker = int(state["next_worker"])

    def _load_global(self, state: dict[str, Any], g: int, world: int) -> None:
        ds = self.dataset
        mine = {
            "dataset": ds.version.ref,
            "seed": ds.config.seed,
            "shuffle_buffer": ds.config.shuffle_buffer,
            "whole": ds.config.whole,
            "global_batch_size": g,
        }
        for key, value in mine.items():
            if state.get(key) != value:
                raise ConfigError(f"loader state has {key}={state.get(key)!r}, this loader has {value!r}")
        rank_share(g, world)
        samples = int(state["samples"])
        if samples % g:
            raise ConfigError(
                f"loader state has samples={samples}, not a whole number of global batches of {g}"
            )
        ds.set_epoch(int(state["epoch"]))
        self._positions, self._next_worker, self._done = {}, 0, samples // g
