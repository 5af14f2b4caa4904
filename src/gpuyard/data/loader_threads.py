"""Thread workers for the loader: the same shipments as DataLoader worker processes, without the transfer.

A worker process hands each shipment to the main process through shared memory: a new shared segment
per shipment, a copy into it, a file descriptor passed over a socket and a mapping on the other side.
For small samples that costs more than reading them (measured on 2 cores: a worker spends about three
times as long shipping 8192 28x28 images as decoding and shuffling them). The expensive steps, Parquet
decoding and the shuffle gather, run in Arrow and NumPy without holding the GIL, so threads overlap
them as well as processes do, and a thread's shipment reaches the consumer as a pointer.

Each thread runs exactly the generator a worker process would (same logical worker, same rows, same
shipment boundaries, same augmentation seeds), and the consumer takes shipments round-robin from the
worker that is due, skipping finished ones, as DataLoader does: batches and ``state_dict`` positions
are identical in both modes, so a run can resume in the other mode.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

_DONE = object()
# Decoded row groups a reader keeps (blocks often straddle one); thread workers share this many each.
OPEN_GROUPS = 4


class RowGroups:
    """Decoded row groups by (shard, row group), the least recently used beyond ``capacity`` dropped.

    The thread workers of an epoch share one: a row group that two workers' ranges straddle is
    decoded once, by the first to ask (with its own open file), while the others wait for it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, int], Future[pa.Table]] = OrderedDict()

    def get(self, key: tuple[int, int], decode: Callable[[int], pa.Table], group: int) -> pa.Table:
        """The row group ``key``, decoded by ``decode(group)`` unless another reader has it or is at it."""
        with self._lock:
            found = self._items.get(key)
            mine = found is None
            if found is None:
                found = self._items[key] = Future()
                while len(self._items) > self.capacity:
                    self._items.popitem(last=False)
            else:
                self._items.move_to_end(key)
        if mine:
            try:
                found.set_result(decode(group))
            except BaseException as exc:  # every reader waiting for it raises the same error
                found.set_exception(exc)
                with self._lock:
                    if self._items.get(key) is found:
                        del self._items[key]
                raise
        return found.result()


class _Worker:
    """One logical worker: a thread filling a bounded queue with its shipments."""

    def __init__(self, ds: Any, args: tuple[int, int, int, int, int, int], depth: int, groups: Any) -> None:
        # A private shallow copy: open files are per reader, never shared; decoded row groups are
        # shared between the epoch's workers (``groups``), so a row group two ranges straddle is
        # decoded once.
        self.ds = copy.copy(ds)
        self.ds.shared_groups = groups
        self.args = args
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"gpuyard-loader-{args[2]}", daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        rank, world, worker, workers, start, span = self.args
        ds = self.ds
        key = ds.aug_key(rank, worker)
        try:
            for arrays, pos in ds._chunks(rank, world, worker, workers, start, span):
                if not self._put(ds._shipment(arrays, worker, pos, key, shared=False)):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it in its own thread
            self._put(exc)
            return
        self._put(_DONE)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def iter_shipments(
    ds: Any, rank: int, world: int, workers: int, starts: dict[int, int], first: int, depth: int
) -> Iterator[dict[str, Any]]:
    """Shipments of ``workers`` thread workers, round-robin from logical worker ``first``.

    Args:
        ds: the :class:`~gpuyard.data.loader_dataset.ShardDataset` (copied per thread).
        rank: this process's rank; world: the world size.
        workers: number of logical workers (threads).
        starts: rows already emitted per logical worker (from a resumed state).
        first: the logical worker due first.
        depth: shipments each thread may prepare ahead (DataLoader's ``prefetch_factor``).
    """
    span = ds.ship_batches * ds.batch_rows
    groups = RowGroups(OPEN_GROUPS * workers)
    pool = [
        _Worker(ds, (rank, world, k, workers, starts.get(k, 0), span), depth, groups) for k in range(workers)
    ]
    try:
        active = [(first + i) % workers for i in range(workers)]
        while active:
            for k in list(active):
                item = pool[k].queue.get()
                if item is _DONE:
                    active.remove(k)
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for w in pool:
            w.close()
