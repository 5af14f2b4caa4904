"""Which rows of a version a (rank, worker) consumer reads in an epoch, and reading them from the
version's Parquet shards: a few files open, decoded row groups kept, blocks of ``shuffle_buffer`` rows
permuted by their seed (see :mod:`gpuyard.data.loader` for the order this makes)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gpuyard.data.augment import augment, batch_generator
from gpuyard.data.cache import ShardCache
from gpuyard.data.columns import permuted, tensor_chunks, tensor_to_numpy
from gpuyard.data.dataset import DatasetVersion, open_dataset, shard_location
from gpuyard.data.loader_config import LoaderConfig, rank_share, topology
from gpuyard.data.loader_threads import OPEN_GROUPS, RowGroups
from gpuyard.data.recipe import Augment
from gpuyard.data.shards import open_parquet, row_group_bounds
from gpuyard.errors import ConfigError, IntegrityError
from gpuyard.store import get_artifacts

# Shards a reader keeps open at once (least recently used beyond that are closed).
OPEN_SHARDS = 4


class ShardReader:
    """A version's rows as a :class:`~gpuyard.data.loader.ShardDataset` plans and reads them: its
    settings, each consumer's range of rows this epoch, and the shards' columns as NumPy arrays."""

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

    def _read(self, shard: int, rows: np.ndarray) -> dict[str, list[np.ndarray]]:
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
        return {c: self._column_parts(table, c) for c in self._columns}

    def _to_numpy(self, table: pa.Table, name: str) -> np.ndarray:
        col = table.column(name)
        if name in self._specs:
            return tensor_to_numpy(col, self._specs[name])
        return np.asarray(col.to_numpy(zero_copy_only=False))

    def _column_parts(self, table: pa.Table, name: str) -> list[np.ndarray]:
        """Column ``name`` as one array per Arrow chunk (tensor columns as views): a block gathers
        its rows from them in one pass (:func:`~gpuyard.data.columns.permuted`)."""
        col = table.column(name)
        if name in self._specs:
            return tensor_chunks(col, self._specs[name])
        if col.num_chunks == 1:
            return [np.asarray(col.chunk(0).to_numpy(zero_copy_only=False))]
        return [np.asarray(col.to_numpy(zero_copy_only=False))]

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
        chunks = {c: [a for p in parts for a in p[c]] for c in self._columns}
        if not permute:
            return {c: np.concatenate(a) if len(a) > 1 else a[0] for c, a in chunks.items()}
        if not self.config.shuffle:  # a block of its own: never a view of the shared decoded groups
            return {c: np.concatenate(a) if len(a) > 1 else a[0].copy() for c, a in chunks.items()}
        n = sum(len(a) for a in next(iter(chunks.values())))
        perm = np.random.default_rng([*key, k]).permutation(n)
        return {c: permuted(a, perm) for c, a in chunks.items()}

    def _augment_batch(self, images: torch.Tensor, pos: int, key: tuple[int, ...]) -> torch.Tensor:
        assert self._augment is not None  # callers check
        return augment(images, self._augment, batch_generator(*key, pos))

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

    def __getstate__(self) -> dict[str, Any]:
        # Open files and decoded row groups stay in the process that opened them.
        skip = ("_files", "_groups", "_whole", "shared_groups")
        return {k: v for k, v in self.__dict__.items() if k not in skip}
