"""Whole mode: a version that fits in memory decoded once, each epoch one seeded permutation of this
rank's rows, each batch a gather from memory (``LoaderConfig(whole=True)``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from gpuyard.data.loader_config import POSITION_KEY, Batch, rank_share
from gpuyard.data.loader_reading import ShardReader


class WholeBatches(ShardReader):
    """Whole mode's row order and batches."""

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
