"""In-memory checkpoints: a host-memory snapshot every N steps, a replica on the next rank, storage every M.

(File names, the restore plan and private folders: :mod:`gpuyard.train.snapshot_files`; the state
tree laid out in a data file and filled back: :mod:`gpuyard.train.snapshot_tree`.)

Where a snapshot lives: in the node's snapshot folder (``$GPUYARD_SNAPSHOT_DIR/holder-<rank>/``,
in ``/dev/shm``, so host memory), each owner (this rank, and the previous rank whose replica this
rank keeps) has two data files, ``o<owner>-slot<0|1>.bin``: its tensors back to back, mapped into
the process and reused from snapshot to snapshot, and a small description per snapshot,
``o<owner>-s<step>-w<world>-g<slot>.snap`` (the tree, where each tensor lies, the rank's small
state), written last: a snapshot is complete once its description exists. A new snapshot goes
into the slot not holding the owner's newest one, whose description is removed first, so the
newest complete snapshot is never overwritten and a rank killed halfway leaves it whole.

Ahead of the first snapshot (``state=``, at the second update, when the optimizer has its state):
the layout is made and the background copy worker maps both slots and allocates their pages
(:meth:`MemoryCheckpointer.prepare`), so the first snapshot's copy, which the next update waits
for, does not allocate its destination a page at a time.

What happens at a snapshot step (every rank, ``checkpoint.memory_every``):

1. **In the training thread**: buffers (which the next forward may change) are copied into the
   slot's data file; on CUDA every tensor is copied non-blocking into pinned staging buffers
   (stream-ordered: the next optimizer step cannot overtake it).
2. **In a background thread**: parameters and optimizer state (changed only by the optimizer
   step, which waits for this: :meth:`MemoryCheckpointer.before_update`) are copied into the data
   file; then, at a lower CPU priority, the description is written, the snapshot is sent to rank
   ``(r + 1) % world`` over a gloo side group (isend/irecv straight from and into the mapped data
   files), which keeps it as a replica; every ``checkpoint.persist_every`` steps the same host copy
   is also written to storage as an ordinary checkpoint (``dcp.save`` on the side group, then the
   marker and rename of :class:`~gpuyard.train.checkpoint.Checkpointer`). The next snapshot, a
   storage checkpoint and the end of the run wait for it first.

The snapshot folder belongs to the node's launcher (``gpuyard train`` creates it, hands it to every
rank through ``GPUYARD_SNAPSHOT_DIR`` and removes it when torchrun exits), so it outlives a killed
rank and torchrun's restart of the worker group. On restart every rank lists what it holds (its own
snapshots and the replicas it keeps), the ranks agree on the newest step every rank can get (from its
own folder, else from the rank holding its replica) and restore from memory when that step is not
older than the newest storage checkpoint; otherwise they resume from storage as before.

Privacy and integrity: every folder here is this user's alone. The launcher's folder has a random
name and mode 0700 (``tempfile.mkdtemp``); without a launcher the folder's name is predictable, so
it is created 0700, and a path that already exists is used only if it is a real folder (not a
link) owned by this user with mode 0700 (:func:`private_dir`): anything else is refused in one line
naming it, before a byte is written or read. Files are opened with ``O_NOFOLLOW`` (descriptions
also ``O_EXCL``). Each description carries the SHA-256 of its data file, computed in the background
thread; at restore every held snapshot the chosen plan uses is checked against it before a byte
of it is used, and one that fails (its data changed in memory, or a replica that arrived damaged) is
dropped with a warning, never restored, and the ranks plan again without it.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.errors import PermissionDenied
from gpuyard.train.checkpoint import HASH, Checkpointer
from gpuyard.train.names import SNAPSHOT_DIR_ENV
from gpuyard.train.snapshot_files import (
    KEEP_STEPS,
    Holding,
    bytes_of,
    data_name,
    default_snapshot_dir,
    digest,
    map_file,
    no_follow,
    own_file,
    parse_name,
    plan_restore,
    private_dir,
    snapshot_name,
    touch_pages,
)
from gpuyard.train.snapshot_tree import (
    Entry,
    copy_value,
    fill,
    flatten,
    host_tree,
    local_tensor,
    plain,
    plan_layout,
    read_snapshot,
    total_bytes,
    view_of,
)

# The names the trainer, the tests and the benchmarks import from here.
__all__ = [
    "KEEP_STEPS",
    "SNAPSHOT_DIR_ENV",
    "Holding",
    "MemoryCheckpointer",
    "Restored",
    "default_snapshot_dir",
    "fill",
    "local_tensor",
    "parse_name",
    "plan_restore",
    "private_dir",
    "read_snapshot",
    "snapshot_name",
]


def _lower_priority() -> None:
    """Give the calling thread a lower CPU priority (Linux: per thread), so that on a machine
    without spare cores the training thread is served first."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _wait_all(*requests: Any) -> None:
    for req in requests:
        if req is not None:
            req.wait()


@dataclass
class Restored:
    """What :meth:`MemoryCheckpointer.restore` hands back: the step, this rank's saved trees, where
    each rank's state came from ({rank: 'memory' | 'peer <holder>'}) and the seconds it took."""

    step: int
    app: dict[str, Any]
    rank_state: dict[str, Any]
    sources: dict[int, str]
    seconds: float


def _serve(owner: weakref.ref[MemoryCheckpointer], jobs: queue.SimpleQueue[Any]) -> None:
    # A snapshot worker's loop: each job handed to it run by its checkpointer; None ends it.
    me = owner()
    if me is not None and jobs is me._slow:
        _lower_priority()  # the rest is not waited for by the next step: training first
    del me
    while (job := jobs.get()) is not None:
        me = owner()
        if me is None:
            return
        if isinstance(job, _Prepare):
            me._prepare_job(job)
        elif jobs is me._jobs:
            me._copy_job(*job)
        else:
            me._background(*job)
        del me


@dataclass
class _Prepare:
    """A job for the background worker: map this rank's free slots for `layout` and allocate their
    pages, then set `ready`."""

    layout: list[Entry]
    ready: threading.Event


def _stop(queues: Sequence[queue.SimpleQueue[Any]], workers: Sequence[threading.Thread] = ()) -> None:
    # End the workers (after the jobs already queued) and wait for them, a bounded time.
    for jobs in queues:
        jobs.put(None)
    for worker in workers:
        if worker.is_alive() and worker is not threading.current_thread():
            worker.join(timeout=60)


class MemoryCheckpointer:
    """In-memory snapshots of one rank, their replica on the next rank, and restore (see the module).

    Every rank constructs it (it makes a process group) and calls :meth:`snapshot` and
    :meth:`restore` at the same steps.
    """

    def __init__(
        self,
        folder: str | Path,
        rank: int,
        world_size: int,
        checkpointer: Checkpointer | None = None,
        state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """
        Args:
            folder: the node's snapshot folder (private to this user; see the module).
            rank, world_size: this rank and the ranks in all.
            checkpointer: storage checkpoints (persisted snapshots go there).
            state: the state snapshots will take (as ``app_state`` of :meth:`snapshot`), called once,
                at the second :meth:`before_update` (the first update has made the optimizer's
                state), to lay out and allocate the data files ahead of the first snapshot
                (:meth:`prepare`). None: the first snapshot allocates them.
        """
        self.folder = Path(folder)
        self.rank, self.world_size = rank, world_size
        self.holder_dir = self.folder / f"holder-{rank}"
        # Only this user's folders (a pre-planted path is refused; see the module).
        private_dir(self.folder)
        private_dir(self.holder_dir)
        self.checkpointer = checkpointer
        self._group: Any = None
        if dist.is_available() and dist.is_initialized():
            # Replica exchange and background persists run their own collectives: a separate gloo
            # group keeps them from interleaving with the training collectives (and works on CPU
            # tensors whatever the training backend is).
            self._group = dist.new_group(backend="gloo")
        self._stores: dict[tuple[int, int], torch.Tensor] = {}  # (owner, slot) -> mapped data file
        self._staging: dict[int, torch.Tensor] = {}  # pinned buffers for CUDA tensors, by index
        # Two long-lived workers (started at the first snapshot; starting a thread per snapshot
        # cost the training thread 5-20 ms on a loaded machine, waiting for it to be scheduled):
        # one copies what the next update waits for, at normal priority; the other (lower CPU
        # priority) hashes, writes the description, sends the replica and persists.
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slow: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._done: threading.Event | None = None  # set when the last snapshot's work is over
        # The flattened layout of the last snapshot, reused while the tensors stay the same
        # (same storage, shape and dtype, as between steps of a plain model and optimizer).
        self._key: tuple[Any, ...] | None = None
        self._layout: list[Entry] = []
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # slot -> (store, views)
        self._error: BaseException | None = None
        self.stalls: list[float] = []
        self.copy_waits: dict[int, float] = {}  # snapshot step -> wait before the next update
        self._copied: tuple[int, threading.Event] | None = None
        self.warnings: list[str] = []  # snapshots not written (the run goes on); the trainer reports them
        self.last_background_s = 0.0
        self.last_verify_s = 0.0  # seconds the last restore spent checking SHA-256 (part of its time)
        self._state = state
        self._updates = 0  # before_update() calls (the state is laid out at the second)
        self._ready: threading.Event | None = None  # set when prepare()'s background work is over
        self.prepare_s = 0.0  # seconds that work took (in the background copy worker)

    # ----- files --------------------------------------------------------------------------------
    def _free_slot(self, owner: int) -> int:
        """The slot not holding the owner's newest snapshot here (that one must stay whole)."""
        held = [h for h in self.inventory() if h.owner == owner]
        return 1 - max(held).slot if held else 0

    def _drop_slot(self, owner: int, slot: int) -> None:
        """Forget the snapshot in a slot before its data file is overwritten."""
        for h in self.inventory():
            if h.owner == owner and h.slot == slot:
                (self.holder_dir / snapshot_name(h)).unlink(missing_ok=True)

    def _store(self, owner: int, slot: int, size: int) -> torch.Tensor:
        store = self._stores.get((owner, slot))
        if store is None or store.numel() != size:
            self._stores.pop((owner, slot), None)
            store = map_file(self.holder_dir / data_name(owner, slot), size)
            self._stores[(owner, slot)] = store
        return store

    def _write_meta(self, h: Holding, doc: dict[str, Any]) -> Path:
        path = self.holder_dir / snapshot_name(h)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.unlink(missing_ok=True)  # left by a rank killed while writing it
        try:
            with open(tmp, "xb", opener=no_follow) as fh:  # "x": O_CREAT | O_EXCL
                torch.save(doc, fh)
            tmp.replace(path)  # the snapshot is complete once its description is there
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return path

    # ----- taking a snapshot --------------------------------------------------------------------
    def snapshot(
        self,
        step: int,
        app_state: dict[str, Any],
        rank_state: dict[str, Any],
        meta: dict[str, Any],
        persist: bool = False,
        defer: Collection[int] = (),
    ) -> float:
        """Copy the state into this rank's data file in /dev/shm and hand the rest to a background
        thread (collective).

        Args:
            step: optimizer step of the state.
            app_state: model and optimizer state dict (as for DCP).
            rank_state: this rank's small state.
            meta: JSON-able facts (also written into a persisted checkpoint's marker).
            persist: also write this snapshot to storage (in the background).
            defer: ``data_ptr()`` of CPU tensors that only the next optimizer step changes
                (parameters, optimizer state): their copy is left to the background thread, and
                the caller calls :meth:`before_update` before that step. Others are copied here.

        Returns:
            The seconds the calling (training) thread was held: waiting for the previous
            snapshot's background work, plus the copies not deferred.
        """
        start = time.perf_counter()
        self.wait()
        self._wait_ready()
        self._state = None  # laid out now: nothing left to prepare
        tensors: list[torch.Tensor] = []
        tree = flatten(app_state, tensors)
        local = [plain(t) for t in tensors]
        layout = self._lay_out(local)
        held = [h for h in self.inventory() if h.owner == self.rank]
        slot = 1 - max(held).slot if held else 0
        for h in held:
            if h.slot == slot:  # forget the snapshot in that slot before its data is overwritten
                (self.holder_dir / snapshot_name(h)).unlink(missing_ok=True)
        host: dict[str, Any] | None = None
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        event = None
        try:
            store = self._store(self.rank, slot, total_bytes(layout))
        except OSError as exc:  # /dev/shm full, say: no snapshot here this step, training goes on
            self.warnings.append(f"step {step}: rank {self.rank} could not write its snapshot: {exc}")
        else:
            cached = self._views.get(slot)
            if cached is None or cached[0] is not store:
                cached = (store, [view_of(store, entry) for entry in layout])
                self._views[slot] = cached
            views = cached[1]
            later = defer if isinstance(defer, (set, frozenset)) else set(defer)
            for i, (src, dst) in enumerate(zip(local, views, strict=True)):
                if src.device.type == "cuda":
                    pinned = self._pinned(i, src)
                    pinned.copy_(src, non_blocking=True)
                    staged.append((dst, pinned))
                elif src.data_ptr() in later:
                    deferred.append((dst, src))  # copied by the background thread, first thing
                else:
                    dst.copy_(src)
            host = host_tree(tree, tensors, views) if persist else {}
            if staged:
                # Queued on the current stream ahead of the next step's kernels; the background
                # thread waits for this event before reading the pinned buffers.
                event = torch.cuda.Event()
                event.record()
        copied = threading.Event()
        if not deferred:
            copied.set()
        self._copied = (step, copied)
        doc = {
            "step": step,
            "world_size": self.world_size,
            "tree": tree,
            "layout": layout,
            "rank_state": copy_value(rank_state),
        }
        self._start_workers()
        self._done = threading.Event()
        self._jobs.put(
            (step, slot, host, doc, dict(meta), persist, event, deferred, staged, copied, self._done)
        )
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        return stall

    def _start_workers(self) -> None:
        if self._workers:
            return
        # The workers hold this object weakly between jobs, and are ended when it is collected
        # unclosed (a crashed run): its mapped files are then released.
        me = weakref.ref(self)
        self._workers = [
            threading.Thread(target=_serve, args=(me, q), name=f"gpuyard-snapshot-{name}", daemon=True)
            for q, name in ((self._jobs, "copy"), (self._slow, "write"))
        ]
        # (also at interpreter exit: ended and joined before the interpreter goes down, not left
        # running into its finalization)
        weakref.finalize(self, _stop, (self._jobs, self._slow), list(self._workers))
        for worker in self._workers:
            worker.start()

    def _lay_out(self, local: Sequence[torch.Tensor]) -> list[Entry]:
        """The data file's layout for these tensors: the last one while they keep their storage,
        shape and dtype (as between steps of a plain model and optimizer), else laid out anew."""
        key = tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in local)
        if key != self._key:  # another model, or tensors reallocated
            self._layout = plan_layout(local)
            self._key = key
            self._views.clear()
        return self._layout

    def _pinned(self, i: int, src: torch.Tensor) -> torch.Tensor:
        # The pinned host buffer that CUDA tensor `i` is staged through (kept from snapshot to snapshot).
        pinned = self._staging.get(i)
        if pinned is None or pinned.shape != src.shape or pinned.dtype != src.dtype:
            pinned = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
            self._staging[i] = pinned
        return pinned

    def prepare(self, app_state: dict[str, Any]) -> None:
        """Get the data files ready for snapshots of a state like `app_state`, off the training step.

        The layout is made here (as the first snapshot would make it) and CUDA tensors get their
        pinned staging buffers; the copy worker then maps this rank's slots and allocates their
        pages. Without this the first snapshot's copy allocated its
        destination a 4 KiB page at a time, and the next update waited for it (412 ms for 150 MiB
        on 2 shared cores at load 10). A slot holding a complete snapshot (a restarted rank's) is
        not touched. The next snapshot waits for this work first (its stall counts what is left).
        """
        self._wait_ready()
        tensors: list[torch.Tensor] = []
        flatten(app_state, tensors)
        local = [plain(t) for t in tensors]
        layout = self._lay_out(local)
        for i, src in enumerate(local):
            if src.device.type == "cuda":
                self._pinned(i, src)
        self._start_workers()
        self._ready = threading.Event()
        # On the copy worker, at normal priority: the first snapshot waits for it, and at the lower
        # priority a loaded machine left it 12 s of wall time for 0.4 s of CPU (measured at load 10).
        self._jobs.put(_Prepare(list(layout), self._ready))

    def _prepare_job(self, job: _Prepare) -> None:
        start = time.perf_counter()
        try:
            held = {h.slot for h in self.inventory() if h.owner == self.rank}
            for slot in (0, 1):
                if slot in held:  # a complete snapshot: left whole
                    continue
                store = self._store(self.rank, slot, total_bytes(job.layout))
                touch_pages(store)
                self._views[slot] = (store, [view_of(store, entry) for entry in job.layout])
        except OSError as exc:  # /dev/shm full, say: the snapshot will say it again, training goes on
            self.warnings.append(f"rank {self.rank}: could not allocate the snapshot files ahead: {exc}")
        finally:
            self.prepare_s = time.perf_counter() - start
            job.ready.set()

    def _wait_ready(self) -> None:
        if self._ready is not None:
            self._ready.wait()
            self._ready = None

    def _copy_job(self, *job: Any) -> None:
        deferred, copied, done = job[7], job[9], job[10]
        try:
            for dst, src in deferred:
                dst.copy_(src)
        except BaseException as exc:  # handed to the training thread at the next wait()
            self._error = exc
            done.set()
            return
        finally:
            copied.set()  # the optimizer step may go on (an error is raised at wait())
        self._slow.put(job)

    def _background(
        self,
        step: int,
        slot: int,
        host: dict[str, Any] | None,
        doc: dict[str, Any],
        meta: dict[str, Any],
        persist: bool,
        event: Any,
        deferred: list[tuple[torch.Tensor, torch.Tensor]],
        staged: list[tuple[torch.Tensor, torch.Tensor]],
        copied: threading.Event,
        done: threading.Event,
    ) -> None:
        start = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()
            for dst, pinned in staged:
                dst.copy_(pinned)
            own = None
            if host is not None:
                doc[HASH] = digest(self._stores[(self.rank, slot)])  # checked before any restore
                try:
                    self._write_meta(Holding(self.rank, step, self.world_size, slot), {**doc, "slot": slot})
                    own = self._stores[(self.rank, slot)]
                except OSError as exc:
                    self.warnings.append(f"step {step}: rank {self.rank} could not write its snapshot: {exc}")
            if self._group is not None and self.world_size > 1:
                self._share(step, doc if own is not None else None, own)
            self._prune()
            if own is not None:
                # Make the other slot ready now, off the training thread: the next snapshot then
                # finds its file allocated (only a run's first snapshot pays for that).
                other = self.holder_dir / data_name(self.rank, 1 - slot)
                fresh = not other.exists()
                with contextlib.suppress(OSError):
                    if fresh:  # (an existing one may hold the previous snapshot: left alone)
                        # Its pages allocated now, rather than in the next snapshot's copy.
                        touch_pages(self._store(self.rank, 1 - slot, own.numel()))
            if persist and self.checkpointer is not None:
                if host is None:
                    raise RuntimeError(f"step {step}: no host copy to persist (see the warning before)")
                self.checkpointer.save(
                    step, host, doc["rank_state"], meta, group=self._group, background=True
                )
        except BaseException as exc:  # handed to the training thread at the next wait()
            self._error = exc
        finally:
            self.last_background_s = time.perf_counter() - start
            done.set()

    def _share(self, step: int, doc: dict[str, Any] | None, data: torch.Tensor | None) -> None:
        """Send this rank's snapshot to the next rank, keep the previous rank's. A rank without a
        snapshot takes part all the same (an empty one), or the next rank would wait for it."""
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        meta_out = torch.empty(0, dtype=torch.uint8)
        if doc is not None and data is not None:
            buf = io.BytesIO()
            torch.save(doc, buf)
            meta_out = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        data_out = data if data is not None and meta_out.numel() else torch.empty(0, dtype=torch.uint8)
        sizes_out = torch.tensor([meta_out.numel(), data_out.numel()], dtype=torch.int64)
        sizes_in = torch.zeros(2, dtype=torch.int64)
        self._pair(sizes_out, sizes_in, nxt, prev)
        meta_in = torch.empty(int(sizes_in[0]), dtype=torch.uint8)
        self._pair(meta_out, meta_in, nxt, prev)
        size = int(sizes_in[1])
        replica: torch.Tensor | None = None
        slot = self._free_slot(prev)
        if size and meta_in.numel():
            self._drop_slot(prev, slot)
            try:
                replica = self._store(prev, slot, size)
            except OSError as exc:
                self.warnings.append(
                    f"step {step}: rank {self.rank} could not keep rank {prev}'s replica: {exc}"
                )
        # Received straight into the replica's data file (or, without room for it, dropped).
        self._pair(
            data_out, replica if replica is not None else torch.empty(size, dtype=torch.uint8), nxt, prev
        )
        if replica is None or not meta_in.numel():
            return
        received = torch.load(io.BytesIO(bytes_of(meta_in)), weights_only=True)
        try:
            self._write_meta(Holding(prev, step, self.world_size, slot), {**received, "slot": slot})
        except OSError as exc:
            self.warnings.append(f"step {step}: rank {self.rank} could not keep rank {prev}'s replica: {exc}")

    def _pair(self, out: torch.Tensor, into: torch.Tensor, to: int, source: int) -> None:
        """isend `out` to `to` and irecv `into` from `source` (an empty side is skipped: both
        ends know the sizes)."""
        send = dist.isend(out, to, group=self._group) if out.numel() else None
        recv = dist.irecv(into, source, group=self._group) if into.numel() else None
        _wait_all(send, recv)

    def _prune(self) -> None:
        """Keep each owner's two newest snapshots (its two slots); forget older descriptions."""
        by_owner: dict[int, list[Holding]] = {}
        for h in self.inventory():
            by_owner.setdefault(h.owner, []).append(h)
        for held in by_owner.values():
            for h in sorted(held, reverse=True)[KEEP_STEPS:]:
                (self.holder_dir / snapshot_name(h)).unlink(missing_ok=True)

    def before_update(self) -> float:
        """Wait until the deferred copies of the last snapshot are done (call before the optimizer
        step that follows it); returns the seconds waited, also kept in ``copy_waits[step]``. At
        the second call, before any snapshot, the state given as ``state=`` is taken and the data
        files are made ready for it (:meth:`prepare`)."""
        self._updates += 1
        if self._state is not None and self._updates >= 2:
            state, self._state = self._state, None
            self.prepare(state())
        if self._copied is None:
            return 0.0
        step, copied = self._copied
        self._copied = None
        began = time.perf_counter()
        copied.wait()
        waited = time.perf_counter() - began
        self.copy_waits[step] = waited
        return waited

    def wait(self) -> None:
        """Finish the background work of the last snapshot (collective); re-raise its error."""
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"in-memory checkpoint: background work failed: {error}") from error

    # ----- getting it back ----------------------------------------------------------------------
    def inventory(self) -> list[Holding]:
        """The complete snapshots this rank holds (its own and the replicas it keeps)."""
        if not self.holder_dir.is_dir():
            return []
        return sorted(h for p in self.holder_dir.iterdir() if (h := parse_name(p.name)) is not None)

    def _read_local(self, h: Holding) -> tuple[dict[str, Any], torch.Tensor]:
        meta_path = self.holder_dir / snapshot_name(h)
        fd = os.open(meta_path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            own_file(fh.fileno(), meta_path)
            meta = torch.load(fh, weights_only=True)
        path = self.holder_dir / data_name(h.owner, h.slot)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            own_file(fd, path)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        return meta, data

    def _intact(self, h: Holding) -> tuple[dict[str, Any], torch.Tensor] | None:
        """A held snapshot's description and data when the data matches its hash; one that does
        not is dropped (its description removed) with a warning, and None is returned."""
        whose = "its own snapshot" if h.owner == self.rank else f"rank {h.owner}'s replica"
        try:
            meta, data = self._read_local(h)
            want = meta.get(HASH)
            problem = None
            if want is None:
                problem = "has no content hash"
            elif data.numel() < total_bytes(meta["layout"]) or digest(data) != want:
                problem = f"does not match its {HASH}"
        except (OSError, RuntimeError, ValueError, KeyError, PermissionDenied) as exc:
            problem = f"unreadable ({exc})"
        if problem is None:
            return meta, data
        self.warnings.append(f"rank {self.rank}: {whose} of step {h.step} {problem}: dropped, not restored")
        (self.holder_dir / snapshot_name(h)).unlink(missing_ok=True)
        return None

    def restore(self, storage_step: int) -> Restored | None:
        """Agree on a snapshot step and load this rank's state from memory (collective).

        Args:
            storage_step: the newest complete storage checkpoint's step (-1: none).

        Returns:
            The restored trees (tensors are views of the snapshot's data: :func:`fill` them into
            the live state), or None when no snapshot step is held for every rank at or after
            `storage_step`.
        """
        start = time.perf_counter()
        # Read only from this user's folders (mode 0700), and only snapshots whose data matches.
        private_dir(self.folder, create=False)
        private_dir(self.holder_dir, create=False)
        mine = self.inventory()
        # Plan first, then hash only the snapshots the plan uses (each rank those it provides);
        # one that fails is dropped on every rank's word and the plan made again without it. The
        # older slot is then never hashed (it used to be: half the restore's time).
        verified: dict[Holding, tuple[dict[str, Any], torch.Tensor]] = {}
        self.last_verify_s = 0.0
        while True:
            if self._group is not None and self.world_size > 1:
                everyone: list[Any] = [None] * self.world_size
                dist.all_gather_object(everyone, mine, group=self._group)
            else:
                everyone = [mine]
            plan = plan_restore(everyone, self.world_size, storage_step)
            if plan is None:
                return None
            step, holders = plan
            bad: list[Holding] = []
            for h in mine:
                mine_to_give = h.world_size == self.world_size and holders.get(h.owner) == self.rank
                if h.step == step and mine_to_give and h not in verified:
                    began = time.perf_counter()
                    got = self._intact(h)
                    self.last_verify_s += time.perf_counter() - began
                    if got is None:
                        bad.append(h)
                    else:
                        verified[h] = got
            failed = [bool(bad)]
            if self._group is not None and self.world_size > 1:
                flags: list[Any] = [None] * self.world_size
                dist.all_gather_object(flags, bool(bad), group=self._group)
                failed = flags
            if not any(failed):
                break
            mine = [h for h in mine if h not in bad]
        held = {(h.owner, h.step): h for h in mine}
        doc: dict[str, Any] | None = None
        for owner in range(self.world_size):
            holder = holders[owner]
            if holder == owner:
                if owner == self.rank:
                    doc = read_snapshot(*verified[held[(owner, step)]])
            elif self.rank == holder:
                meta, data = verified[held[(owner, step)]]
                buf = io.BytesIO()
                torch.save(meta, buf)
                self._send(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8), owner)
                self._send(data, owner)
            elif self.rank == owner:
                meta_bytes = self._recv(holder)
                doc = read_snapshot(
                    torch.load(io.BytesIO(bytes_of(meta_bytes)), weights_only=True), self._recv(holder)
                )
        if doc is None:
            raise RuntimeError(f"in-memory checkpoint: rank {self.rank} got no snapshot of step {step}")
        sources = {o: "memory" if h == o else f"peer {h}" for o, h in holders.items()}
        return Restored(step, doc["app"], doc["rank_state"], sources, time.perf_counter() - start)

    def _send(self, data: torch.Tensor, to: int) -> None:
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), to, group=self._group)
        dist.send(data, to, group=self._group)

    def _recv(self, source: int) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, source, group=self._group)
        out = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(out, source, group=self._group)
        return out

    def close(self) -> None:
        """Wait for background work and drop this rank's snapshots (the run ended cleanly)."""
        self.wait()
        self._wait_ready()
        _stop((self._jobs, self._slow), self._workers)
        self._workers = []
        self._stores.clear()
        self._views.clear()
        shutil.rmtree(self.holder_dir, ignore_errors=True)
