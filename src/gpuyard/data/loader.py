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
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, IterableDataset, default_convert, get_worker_info

from gpuyard.data.augment import augment, batch_generator
from gpuyard.data.cache import ShardCache
from gpuyard.data.columns import tensor_to_numpy
from gpuyard.data.dataset import DatasetVersion, open_dataset, shard_location
from gpuyard.data.loader_threads import OPEN_GROUPS, RowGroups, iter_shipments
from gpuyard.data.recipe import Augment
from gpuyard.data.shards import open_parquet, row_group_bounds
from gpuyard.errors import ConfigError, IntegrityError
from gpuyard.store import get_artifacts

POSITION_KEY = "_position"
SIZES_KEY = "_sizes"
# Rows a DataLoader worker sends per transfer: moving a tensor between processes has a fixed cost of
# about a millisecond, so workers ship several batches at once and the main process slices them apart.
SHIPMENT_ROWS = 8192
# Shards a reader keeps open at once (least recently used beyond that are closed).
OPEN_SHARDS = 4
# "process": DataLoader worker processes; "thread": threads in this process (see loader_threads).
WORKER_MODES = ("process", "thread")
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


class ShardDataset(IterableDataset[Batch]):
    """Batches of a version as dicts of tensors (strings as lists), for ``DataLoader(batch_size=None)``.

    Each batch also carries ``_position`` = (worker, rows emitted, epoch), which :class:`ShardLoader`
    removes and uses for :meth:`ShardLoader.state_dict`. Use :class:`ShardLoader` unless you need
    your own DataLoader.
    """

    def __init__(
        self,
        dataset: DatasetVersion | str,
        config: LoaderConfig | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        self.version = open_dataset(dataset) if isinstance(dataset, str) else dataset
        self.config = config or LoaderConfig()
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.start_positions: dict[int, int] = {}
        self.worker_offset = 0
        self.ship_batches = 1
        self._shared: torch.Tensor | None = None
        self._cache = cache
        self._shards = self.version.shards
        self._specs = self.version.tensor_specs()
        cols = list(self.config.columns or self.version.columns)
        self.version._check_columns(cols)
        self._columns = cols
        recipe = self.version.manifest.get("recipe") or {}
        aug = recipe.get("augment") if self.version.manifest["kind"] == "transform" else None
        self._augment = Augment.model_validate(aug) if aug and self.config.augment else None
        if self._augment is not None and self._augment.column not in cols:
            self._augment = None
        self._selected: list[np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (new shard order and permutations) from its beginning."""
        self.epoch = int(epoch)
        self.start_positions = {}

    @property
    def batch_rows(self) -> int:
        """Rows of a batch on this rank: ``batch_size``, or this rank's share of the global batch."""
        g = self.config.global_batch_size
        return self.config.batch_size if g is None else rank_share(g, topology(self.rank, self.world_size)[1])

    def aug_key(self, rank: int, worker: int) -> tuple[int, ...]:
        """Seed key of a consumer's augmentation; in global-batch mode it ignores the worker (whose
        share of the batches depends on the worker count, which may change on resume)."""
        glob = self.config.global_batch_size is not None
        return (self.config.seed, self.epoch, rank, 0 if glob else worker)

    def total_rows(self) -> int:
        """Selected rows of the version (every rank's, one epoch)."""
        if self.config.whole:
            return len(next(iter(self.whole_arrays().values()))) if self._columns else 0
        return sum(len(idx) for _, idx in self.consumer_range(0, 1, 0, 1))

    def global_batch_count(self, rows: int | None = None) -> int:
        """Global batches in an epoch (global-batch mode): ``rows // G`` with ``drop_last``, else
        ``ceil(rows / G)`` (the last one filled from the start of the epoch's order).

        Raises:
            ConfigError: fewer rows than one global batch, with ``drop_last``.
        """
        g = self.config.global_batch_size
        assert g is not None  # callers check the mode
        n = self.total_rows() if rows is None else rows
        if self.config.drop_last and 0 < n < g:
            raise ConfigError(f"{n} rows is fewer than one global batch of {g} (with drop_last)")
        return n // g if self.config.drop_last else -(-n // g)

    # -- planning ----------------------------------------------------------------------------------

    def _rows_per_shard(self) -> list[np.ndarray | None]:
        if self.config.split is None:
            return [None] * len(self._shards)
        if self._selected is None:
            if "split" not in self.version.columns:
                raise ConfigError(f"{self.version.ref} has no split column; run a recipe with a split step")
            sel = []
            for i in range(len(self._shards)):
                table = self._file(i).read(columns=["split"])
                sel.append(np.flatnonzero(np.asarray(pc.equal(table.column("split"), self.config.split))))
            self._selected = sel
        return list(self._selected)

    def consumer_range(
        self, rank: int, world: int, worker: int, workers: int
    ) -> list[tuple[int, np.ndarray]]:
        """The (shard, row indices) pieces that one (rank, worker) reads this epoch, in order."""
        selected = self._rows_per_shard()
        counts = np.array(
            [s.rows if sel is None else len(sel) for s, sel in zip(self._shards, selected, strict=True)]
        )
        order = np.arange(len(counts))
        if self.config.shuffle:
            order = np.random.default_rng([self.config.seed, self.epoch]).permutation(len(counts))
        cum = np.concatenate([[0], np.cumsum(counts[order])])
        per_rank = int(cum[-1]) // world
        lo = rank * per_rank + per_rank * worker // workers
        hi = rank * per_rank + per_rank * (worker + 1) // workers
        pieces = []
        for j, shard in enumerate(order):
            a, b = max(lo, int(cum[j])), min(hi, int(cum[j + 1]))
            if a < b:
                local = np.arange(a - cum[j], b - cum[j])
                sel = selected[shard]
                pieces.append((int(shard), local if sel is None else sel[local]))
        return pieces

    def num_rows(self, rank: int | None = None, world_size: int | None = None, workers: int = 1) -> int:
        """Rows this rank reads per epoch (all workers together)."""
        r, w = topology(
            rank if rank is not None else self.rank, world_size if world_size is not None else self.world_size
        )
        if self.config.global_batch_size is not None:
            return self.global_batch_count() * rank_share(self.config.global_batch_size, w)
        return sum(len(idx) for k in range(workers) for _, idx in self.consumer_range(r, w, k, workers))

    # -- reading -----------------------------------------------------------------------------------

    def _file(self, shard: int) -> Any:
        files: OrderedDict[int, tuple[Any, Any, str]] = self.__dict__.setdefault("_files", OrderedDict())
        if shard in files:
            files.move_to_end(shard)
        else:
            info = self._shards[shard]
            path = shard_location(get_artifacts(), info, self._cache)
            pf = open_parquet(path, path)
            files[shard] = (pf, row_group_bounds(pf), path)
            # A reader walks its shards in order: a few open files suffice, and keeping every shard of a
            # large dataset open would hold a descriptor and a footer per shard for the whole epoch.
            while len(files) > OPEN_SHARDS:
                files.popitem(last=False)[1][0].close()
        return files[shard][0]

    def _new_epoch_readers(self) -> None:
        """Reopen shards each epoch (remote ones then go through the cache again and refresh its LRU)
        and start with no decoded row groups, or with the store the epoch's thread workers share."""
        self.__dict__.pop("_files", None)
        shared = self.__dict__.get("shared_groups")
        self.__dict__["_groups"] = shared if shared is not None else RowGroups(OPEN_GROUPS)

    def _read(self, shard: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        self._file(shard)
        pf, bounds, path = self.__dict__["_files"][shard]
        groups: RowGroups = self.__dict__.setdefault("_groups", RowGroups(OPEN_GROUPS))
        starts = np.array([s for s, _ in bounds])
        first, last = (int(np.searchsorted(starts, x, side="right") - 1) for x in (rows[0], rows[-1]))

        def decode(g: int) -> pa.Table:
            try:
                return pf.read_row_group(g, columns=self._columns, use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                raise IntegrityError(f"shard {path} is truncated or corrupt: {exc}") from exc

        parts = [groups.get((shard, g), decode, g) for g in range(first, last + 1)]
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        local = rows - bounds[first][0]
        if local[-1] - local[0] + 1 == len(local):  # a contiguous run: slice, no copy
            table = table.slice(int(local[0]), len(local))
        else:
            table = table.take(pa.array(local))
        return {c: self._to_numpy(table, c) for c in self._columns}

    def _to_numpy(self, table: pa.Table, name: str) -> np.ndarray:
        col = table.column(name)
        if name in self._specs:
            return tensor_to_numpy(col, self._specs[name])
        return np.asarray(col.to_numpy(zero_copy_only=False))

    def _block(
        self, pieces: list[tuple[int, np.ndarray]], k: int, key: tuple[int, ...], permute: bool = True
    ) -> dict[str, np.ndarray]:
        """Block ``k`` of ``pieces`` (``shuffle_buffer`` rows), permuted by (key, k) when shuffling
        and ``permute``; unpermuted, a single piece's columns may be views of the decoded data."""
        size = self.config.shuffle_buffer
        lo, hi, pos, parts = k * size, (k + 1) * size, 0, []
        for shard, rows in pieces:
            a, b = max(lo, pos), min(hi, pos + len(rows))
            if a < b:
                parts.append(self._read(shard, rows[a - pos : b - pos]))
            pos += len(rows)
        if not permute:
            return {
                c: np.concatenate([p[c] for p in parts]) if len(parts) > 1 else parts[0][c]
                for c in self._columns
            }
        n = sum(len(next(iter(p.values()))) for p in parts) if parts else 0
        perm = np.random.default_rng([*key, k]).permutation(n) if self.config.shuffle else np.arange(n)
        return {
            c: (np.concatenate([p[c] for p in parts]) if len(parts) > 1 else parts[0][c])[perm]
            for c in self._columns
        }

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        rank, world = topology(self.rank, self.world_size)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self._shared is not None:
            self.epoch, self.worker_offset = int(self._shared[0]), int(self._shared[1])
            self.start_positions = {k: int(v) for k, v in enumerate(self._shared[2:].tolist())}
        logical = (worker + self.worker_offset) % workers
        start = self.start_positions.get(logical, 0)
        if self.ship_batches <= 1:
            yield from self.iter_consumer(rank, world, logical, workers, start)
            return
        # Shipments end at fixed row positions (multiples of ship_batches * batch_size), so a run
        # resumed mid-shipment ships the rest of it first and the batch order stays exactly the same.
        span = self.ship_batches * self.batch_rows
        key = self.aug_key(rank, logical)
        for arrays, pos in self._chunks(rank, world, logical, workers, start, span):
            yield self._shipment(arrays, logical, pos, key)

    def iter_consumer(
        self, rank: int, world: int, worker: int, workers: int, start: int = 0
    ) -> Iterator[Batch]:
        """Batches of one (rank, worker) consumer this epoch, from row position ``start``."""
        key = self.aug_key(rank, worker)
        for arrays, pos in self._chunks(rank, world, worker, workers, start, self.batch_rows):
            yield self._batch(arrays, worker, pos, key)

    def _chunks(
        self, rank: int, world: int, worker: int, workers: int, start: int, span: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """Rows of one consumer from ``start``, cut where the position is a multiple of ``span``.

        Yields (column arrays, position after them). Blocks after the first are read one ahead in a
        thread.
        """
        if self.config.global_batch_size is not None:
            yield from self._global_chunks(rank, world, worker, workers, start, span)
            return
        self._new_epoch_readers()
        pieces = self.consumer_range(rank, world, worker, workers)
        total = sum(len(r) for _, r in pieces)
        if self.config.drop_last:
            total -= total % self.config.batch_size
        size = self.config.shuffle_buffer
        key = (self.config.seed, self.epoch, rank, worker)
        nblocks = -(-total // size)
        pos, k = start, start // size
        if start >= total:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuyard-prefetch")
        try:
            # The first block is read here: nothing could overlap it, and a hand-over to the thread
            # (started on the first submit) cost more than a one-block epoch's reading on a busy machine.
            ahead: Future[dict[str, np.ndarray]] | None = _done(self._block(pieces, k, key))
            carry: dict[str, np.ndarray] | None = None
            skip = start - k * size
            while ahead is not None:
                block = ahead.result()
                k += 1
                ahead = pool.submit(self._block, pieces, k, key) if k < nblocks else None
                if skip:
                    block, skip = {c: a[skip:] for c, a in block.items()}, 0
                if carry is not None:
                    block = {c: np.concatenate([carry[c], block[c]]) for c in self._columns}
                n = min(len(block[self._columns[0]]), total - pos)
                s = 0
                while True:
                    cut = (pos // span + 1) * span - pos  # rows up to the next multiple of span
                    if s + cut > n:
                        break
                    pos += cut
                    yield {c: a[s : s + cut] for c, a in block.items()}, pos
                    s += cut
                carry = {c: a[s:n] for c, a in block.items()} if s < n else None
            if carry is not None:
                pos += len(carry[self._columns[0]])
                yield carry, pos
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _global_chunks(
        self, rank: int, world: int, worker: int, workers: int, start: int, span: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """Global-batch mode: this rank's rows from its position ``start``, cut at multiples of ``span``.

        The epoch's rows (every rank's) form one stream in the seeded shard order; block k of it
        (``shuffle_buffer`` rows) is permuted by (seed, epoch, k), and the permuted stream, wrapped
        past its end, is cut into global batches of G rows, of which this rank takes its slice. The
        rank's position p is ``batches * G/W + offset``; chunk j (positions ``[j*span, (j+1)*span)``)
        goes to worker ``(j - start // span) % workers``, so DataLoader's round-robin from worker 0
        yields them in order whatever the worker count. A rank decodes every block its rows fall in
        (all of them: its rows are spread over each block); the next window of rows is read and
        gathered ahead in a thread.
        """
        self._new_epoch_readers()
        g = self.config.global_batch_size
        assert g is not None  # _chunks checks
        per = rank_share(g, world)
        pieces = self.consumer_range(0, 1, 0, 1)  # every selected row, in this epoch's shard order
        n = sum(len(r) for _, r in pieces)
        total = self.global_batch_count(n) * per
        if start >= total:
            return
        size = self.config.shuffle_buffer

        def permuted(local: np.ndarray) -> np.ndarray:
            """Positions in the permuted epoch stream of this rank's positions ``local``."""
            return ((local // per) * g + rank * per + local % per) % n

        def load(k: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
            """Block k as stored, and its permutation (seeded by seed, epoch, k: no rank, no worker)."""
            arrays = self._block(pieces, k, (), permute=False)
            m = min(size, n - k * size)
            perm = np.random.default_rng([self.config.seed, self.epoch, k]).permutation(m)
            return arrays, perm if self.config.shuffle else None

        blocks: OrderedDict[int, tuple[dict[str, np.ndarray], np.ndarray | None]] = OrderedDict()

        def gather(lo: int, hi: int) -> dict[str, np.ndarray]:
            """This rank's rows at positions [lo, hi), from the (at most 2) blocks kept decoded.
            Runs in one thread at a time (the first window in the caller's, the rest in the read-ahead
            thread, each after the last): the blocks, open files and row groups are never shared."""
            q = permuted(np.arange(lo, hi))
            ks = q // size
            parts = []
            for seg in np.split(np.arange(len(q)), np.flatnonzero(np.diff(ks)) + 1):
                k = int(ks[seg[0]])
                if k not in blocks:
                    blocks[k] = load(k)
                    while len(blocks) > 2:
                        blocks.popitem(last=False)
                blocks.move_to_end(k)
                arrays, perm = blocks[k]
                idx = q[seg] - k * size
                if perm is not None:
                    idx = perm[idx]
                parts.append({c: a[idx] for c, a in arrays.items()})
            return {
                c: np.concatenate([p[c] for p in parts]) if len(parts) > 1 else parts[0][c]
                for c in self._columns
            }

        # Without workers a window is about a block's worth of this rank's rows, cut into spans (per-
        # batch index arithmetic would cost more than the gather); a worker's window is one shipment.
        group = max(1, -(-size // (world * span))) if workers == 1 else 1
        step = group if workers == 1 else workers
        windows = (
            (max(start, j * span), min((j + group) * span, total))
            for j in range(start // span + worker, -(-total // span), step)
        )
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuyard-prefetch")
        try:
            current = next(windows, None)  # the first window is gathered here, as in _chunks
            ahead = _done(gather(*current)) if current is not None else None
            while current is not None and ahead is not None:
                rows = ahead.result()
                lo, hi = current
                current = next(windows, None)  # the next window is gathered while this one is used
                ahead = pool.submit(gather, *current) if current is not None else None
                at = lo
                while at < hi:
                    cut = min((at // span + 1) * span, hi)
                    yield {c: a[at - lo : cut - lo] for c, a in rows.items()}, cut
                    at = cut
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _augment_batch(self, images: torch.Tensor, pos: int, key: tuple[int, ...]) -> torch.Tensor:
        assert self._augment is not None  # callers check
        return augment(images, self._augment, batch_generator(*key, pos))

    def _batch(self, arrays: dict[str, np.ndarray], worker: int, pos: int, key: tuple[int, ...]) -> Batch:
        out: Batch = {}
        for name, arr in arrays.items():
            out[name] = arr.tolist() if arr.dtype == object else torch.from_numpy(np.ascontiguousarray(arr))
        if self._augment is not None:
            col = self._augment.column
            out[col] = self._augment_batch(out[col], pos, key)
        out[POSITION_KEY] = torch.tensor([worker, pos, self.epoch], dtype=torch.int64)
        return out

    def _shipment(
        self, arrays: dict[str, np.ndarray], worker: int, pos: int, key: tuple[int, ...], shared: bool = True
    ) -> Batch:
        # Tensors are allocated in shared memory and filled once, so sending them to the main process
        # copies nothing more; batch boundaries and augmentation seeds match iter_consumer exactly.
        # Thread workers (shared=False) wrap the arrays as they are: they are fresh (the shuffle gather
        # made them), so augmenting them in place touches nothing else.
        n = len(arrays[self._columns[0]])
        bs = self.batch_rows
        first = pos - n
        sizes = []
        at = first
        while at < pos:
            step = min((at // bs + 1) * bs, pos) - at
            sizes.append(step)
            at += step
        out: Batch = {}
        for name, arr in arrays.items():
            if arr.dtype == object:
                out[name] = arr.tolist()
                continue
            if shared:
                t = torch.empty(arr.shape, dtype=torch.from_numpy(arr[:0]).dtype).share_memory_()
                t.numpy()[...] = arr
            else:
                t = torch.from_numpy(np.ascontiguousarray(arr))
            out[name] = t
        if self._augment is not None:
            col, at = self._augment.column, 0
            for step in sizes:
                out[col][at : at + step] = self._augment_batch(
                    out[col][at : at + step], first + at + step, key
                )
                at += step
        out[POSITION_KEY] = torch.tensor([worker, pos, self.epoch], dtype=torch.int64)
        out[SIZES_KEY] = torch.tensor(sizes, dtype=torch.int64)
        return out

    # -- whole mode ----------------------------------------------------------------------------------

    def whole_arrays(self) -> dict[str, np.ndarray]:
        """Every selected row's columns, decoded once and kept (tensor columns as ``(N, *shape)``)."""
        found: dict[str, np.ndarray] | None = self.__dict__.get("_whole")
        if found is None:
            table = self.version.to_arrow(self._columns, self.config.split)
            found = {c: self._to_numpy(table, c) for c in self._columns}
            for name, arr in found.items():
                if arr.dtype != object and not arr.flags.c_contiguous:
                    found[name] = np.ascontiguousarray(arr)
            self.__dict__["_whole"] = found
        return found

    def whole_rows(self, rank: int, world: int) -> np.ndarray:
        """This rank's rows (indices into :meth:`whole_arrays`) this epoch, in the order they are read.

        One permutation of all rows seeded by (seed, epoch), cut into ``world`` equal parts (up to
        ``world_size - 1`` rows per epoch are left out so ranks stay in step, as when streaming). In
        global-batch mode the permutation is cut into global batches instead (wrapped or dropped at
        the tail, as when streaming) and the rank takes its slice of each.
        """
        n = self.total_rows()
        order = (
            np.random.default_rng([self.config.seed, self.epoch]).permutation(n)
            if self.config.shuffle
            else np.arange(n)
        )
        g = self.config.global_batch_size
        if g is not None:
            per = rank_share(g, world)
            local = np.arange(self.global_batch_count(n) * per)
            return order[((local // per) * g + rank * per + local % per) % max(n, 1)]
        per_rank = n // world
        return order[rank * per_rank : (rank + 1) * per_rank]

    def iter_whole(self, rank: int, world: int, start: int = 0) -> Iterator[Batch]:
        """Batches of whole mode for ``rank`` this epoch, from row position ``start`` (each with its
        position under ``POSITION_KEY``, as streamed batches have)."""
        for batch, pos in self.whole_batches(rank, world, start):
            batch[POSITION_KEY] = torch.tensor([0, pos, self.epoch], dtype=torch.int64)
            yield batch

    def whole_batches(self, rank: int, world: int, start: int = 0) -> Iterator[tuple[Batch, int]]:
        """(batch, row position after it) of whole mode for ``rank`` this epoch, from ``start``.

        Each batch is one ``ndarray.take`` per column into a fresh array, wrapped as a tensor without
        a copy; the loader keeps the position itself, so no position tensor is built per batch (at
        millions of samples a second that bookkeeping was a fifth of the epoch).
        """
        arrays = list(self.whole_arrays().items())
        rows = self.whole_rows(rank, world)
        bs = self.batch_rows
        total = len(rows) - (len(rows) % bs if self.config.drop_last else 0)
        key = self.aug_key(rank, 0)
        col = self._augment.column if self._augment is not None else None
        for pos in range(start, total, bs):
            end = min(pos + bs, total)
            idx = rows[pos:end]
            out: Batch = {
                c: a[idx].tolist() if a.dtype == object else torch.from_numpy(a.take(idx, axis=0))
                for c, a in arrays
            }
            if col is not None:
                out[col] = self._augment_batch(out[col], end, key)
            yield out, end

    def __getstate__(self) -> dict[str, Any]:
        # Open files and decoded row groups stay in the process that opened them.
        skip = ("_files", "_groups", "_whole", "shared_groups")
        return {k: v for k, v in self.__dict__.items() if k not in skip}


def _done(value: Any) -> Future[Any]:
    """A future already holding ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


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
