"""The loader's dataset: a torch IterableDataset of a version's batches, streamed in blocks read one
ahead, cut into batches or (for DataLoader workers) shipments of several (see :mod:`gpuyard.data.loader`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gpuyard.data.loader_config import POSITION_KEY, SIZES_KEY, Batch, rank_share, topology
from gpuyard.data.loader_whole import WholeBatches


class ShardDataset(WholeBatches, IterableDataset[Batch]):
    """Batches of a version as dicts of tensors (strings as lists), for ``DataLoader(batch_size=None)``.

    Each batch also carries ``_position`` = (worker, rows emitted, epoch), which :class:`ShardLoader`
    removes and uses for :meth:`ShardLoader.state_dict`. Use :class:`ShardLoader` unless you need
    your own DataLoader.
    """

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


def _done(value: Any) -> Future[Any]:
    """A future already holding ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future
