"""In-memory checkpoints: a host-memory snapshot every N steps, a replica on the next rank, storage every M.

Where a snapshot lives: in the node's snapshot folder (``$GPUYARD_SNAPSHOT_DIR/holder-<rank>/``,
in ``/dev/shm``, so host memory), each owner (this rank, and the previous rank whose replica this
rank keeps) has two data files, ``o<owner>-slot<0|1>.bin``: its tensors back to back, mapped into
the process and reused from snapshot to snapshot, and a small description per snapshot,
``o<owner>-s<step>-w<world>-g<slot>.snap`` (the tree, where each tensor lies, the rank's small
state), written last: a snapshot is complete once its description exists. A new snapshot goes
into the slot not holding the owner's newest one, whose description is removed first, so the
newest complete snapshot is never overwritten and a rank killed halfway leaves it whole.

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
import copy
import errno
import hashlib
import io
import os
import queue
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.errors import PermissionDenied
from gpuyard.train.checkpoint import HASH, Checkpointer
from gpuyard.train.names import SNAPSHOT_DIR_ENV

__all__ = ["SNAPSHOT_DIR_ENV"]  # and the classes below; the name stays importable from here
KEEP_STEPS = 2  # snapshot steps kept per holder: a snapshot cut short leaves the previous one whole
_SUFFIX = ".snap"


def default_snapshot_dir(run_dir: Path) -> Path:
    """Where snapshots go without a launcher: ``$GPUYARD_SNAPSHOT_DIR``, else a folder in /dev/shm
    (host memory) named after the run folder, else the temporary folder."""
    env = os.environ.get(SNAPSHOT_DIR_ENV)
    if env:
        return Path(env)
    import hashlib

    key = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"gpuyard-snap-{os.getuid()}-{key}"


@dataclass(frozen=True, order=True)
class Holding:
    """One snapshot a rank holds: whose state (`owner`), at which step, for which world size, and
    in which of the owner's two data files (`slot`) its tensors are."""

    owner: int
    step: int
    world_size: int
    slot: int = field(default=0, compare=False)


def snapshot_name(h: Holding) -> str:
    """File name of a snapshot's description (owner, step, world size and slot are read back)."""
    return f"o{h.owner}-s{h.step:09d}-w{h.world_size}-g{h.slot}{_SUFFIX}"


def data_name(owner: int, slot: int) -> str:
    """File name of one of an owner's two data files (the tensors, back to back, reused)."""
    return f"o{owner}-slot{slot}.bin"


def parse_name(name: str) -> Holding | None:
    """The holding a snapshot file name describes, or None for anything else (temporary files)."""
    if not name.endswith(_SUFFIX) or not name.startswith("o"):
        return None
    try:
        owner, step, world, slot = name[: -len(_SUFFIX)].split("-")
        return Holding(int(owner[1:]), int(step[1:]), int(world[1:]), int(slot[1:]))
    except ValueError:
        return None


def plan_restore(
    inventories: Sequence[Sequence[Holding]], world_size: int, storage_step: int
) -> tuple[int, dict[int, int]] | None:
    """Choose the snapshot step to restore and which rank provides each rank's state.

    Args:
        inventories: what each rank holds, indexed by rank.
        world_size: ranks now (snapshots of another world size are not used).
        storage_step: step of the newest complete storage checkpoint (-1: none).

    Returns:
        (step, {owner rank: holder rank}) for the newest step that every rank's state is held at
        (the owner itself preferred, else the lowest holder) and that is not older than
        `storage_step`; None when storage (or a fresh start) is the way back.
    """
    held: dict[tuple[int, int], list[int]] = {}
    for holder, inventory in enumerate(inventories):
        for h in inventory:
            if h.world_size == world_size and 0 <= h.owner < world_size:
                held.setdefault((h.owner, h.step), []).append(holder)
    for step in sorted({s for _, s in held}, reverse=True):
        if step < storage_step:
            break
        sources: dict[int, int] = {}
        for owner in range(world_size):
            holders = sorted(held.get((owner, step), []))
            if not holders:
                break
            sources[owner] = owner if owner in holders else holders[0]
        else:
            return step, sources
    return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank; a plain tensor itself.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def fill(live: Any, snap: Any, where: str = "") -> Any:
    """Copy a snapshot tree into a live state tree: tensors in place (a DTensor's local shard),
    other values taken from the snapshot. Returns the filled tree (for ``set_state_dict``).

    Raises:
        ValueError: when the trees differ in keys or tensor shapes (another model or layout).
    """
    if isinstance(live, dict):
        if not isinstance(snap, dict) or live.keys() != snap.keys():
            raise ValueError(f"snapshot does not match the state at {where or '/'}")
        return {k: fill(live[k], snap[k], f"{where}/{k}") for k in live}
    if isinstance(live, (list, tuple)):
        if not isinstance(snap, (list, tuple)) or len(live) != len(snap):
            raise ValueError(f"snapshot does not match the state at {where}")
        return type(live)(fill(a, b, f"{where}/{i}") for i, (a, b) in enumerate(zip(live, snap, strict=True)))
    if isinstance(live, torch.Tensor):
        target = local_tensor(live)
        if not isinstance(snap, torch.Tensor) or target.shape != snap.shape:
            raise ValueError(f"snapshot tensor {where} does not match the state's shape")
        target.copy_(snap)
        return live
    return snap


def _lower_priority() -> None:
    """Give the calling thread a lower CPU priority (Linux: per thread), so that on a machine
    without spare cores the training thread is served first."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _wait_all(*requests: Any) -> None:
    for req in requests:
        if req is not None:
            req.wait()


def _bytes_of(t: torch.Tensor) -> memoryview:
    # A uint8 CPU tensor's memory, without a copy.
    return memoryview(t.numpy().data)


def private_dir(path: str | Path, create: bool = True) -> Path:
    """A folder only this user can use: created with mode 0700 (``create``), or an existing one
    that is a real folder (not a link), owned by this user, with mode 0700.

    Raises:
        PermissionDenied: naming the path, when it is anything else (planted by another user, say).
    """
    path = Path(path)
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise PermissionDenied(f"{path}: snapshot folder missing (not created by this user)") from None
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise PermissionDenied(f"{path}: snapshot folder is {kind} (planted?): refused, never used")
    if st.st_uid != uid:
        raise PermissionDenied(
            f"{path}: snapshot folder belongs to uid {st.st_uid}, not this user ({uid}): refused, never used"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise PermissionDenied(
            f"{path}: snapshot folder has mode {stat.S_IMODE(st.st_mode):o}, not 700: refused, never used"
        )
    return path


def _no_follow(path: str, flags: int) -> int:
    # An opener for open(): never through a link, and a new file readable by this user only.
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def _own_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionDenied(f"{path}: not a file of this user (planted?): refused, never used")


def _digest(data: torch.Tensor) -> str:
    # A uint8 CPU tensor (a mapped data file) hashed in place; hashlib releases the GIL while it runs.
    return hashlib.new(HASH, _bytes_of(data)).hexdigest()


_ALIGN = 64


_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype)


def _copied(value: Any) -> Any:
    """A copy of a small value as ``copy.deepcopy`` makes it, faster for what a snapshot holds
    (random states: tuples of hundreds of ints; scalars): immutable atoms are shared, containers
    rebuilt, tensors cloned, anything else deep-copied."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is tuple or kind is list:
        if all(type(v) in _ATOMS for v in value):
            return value if kind is tuple else list(value)
        return kind(_copied(v) for v in value)
    if kind is dict:
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach().clone()
    return copy.deepcopy(value)


def _flatten(tree: Any, out: list[torch.Tensor]) -> Any:
    """The tree with each tensor replaced by ``{"__t": i}`` (``out[i]`` is the tensor) and every
    other value copied."""
    if isinstance(tree, dict):
        return {k: _flatten(v, out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_flatten(v, out) for v in tree)
    if not isinstance(tree, torch.Tensor):
        return _copied(tree)
    out.append(tree)
    return {"__t": len(out) - 1}


def _plain(t: torch.Tensor) -> torch.Tensor:
    # The local data of a state-dict tensor, out of autograd (state dicts are detached already).
    t = local_tensor(t)
    return t.detach() if t.requires_grad else t


def _plan(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, str, list[int]]]:
    """(offset, bytes, dtype, shape) of each (local) tensor's data in the data file, packed in
    order and 64-byte aligned."""
    out: list[tuple[int, int, str, list[int]]] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append((offset, nbytes, str(t.dtype).removeprefix("torch."), list(t.shape)))
        offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
    return out


def _host(tree: Any, tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> Any:
    """The flattened tree with each tensor replaced by its view in the data file (a DTensor keeps
    its sharding, so a persisted checkpoint has the same DCP layout as a direct save)."""
    if isinstance(tree, dict):
        if tree.keys() == {"__t"}:
            from torch.distributed.tensor import DTensor

            i = tree["__t"]
            t, dst = tensors[i], views[i]
            if not isinstance(t, DTensor):
                return dst
            return DTensor.from_local(
                dst, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return {k: _host(v, tensors, views) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host(v, tensors, views) for v in tree)
    return tree


def _total(layout: list[tuple[int, int, str, list[int]]]) -> int:
    return max(1, layout[-1][0] + layout[-1][1]) if layout else 1


def _view(store: torch.Tensor, entry: tuple[int, int, str, list[int]]) -> torch.Tensor:
    offset, nbytes, dtype, shape = entry
    return store[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)


def _rebuild(tree: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if tree.keys() == {"__t"}:
            return views[tree["__t"]]
        return {k: _rebuild(v, views) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(v, views) for v in tree)
    return tree


def _map(path: Path, size: int) -> torch.Tensor:
    """A uint8 tensor over a /dev/shm file of `size` bytes (created or resized when needed).

    The file is sized, not filled: its pages are allocated when first written, by the background
    copy rather than the training thread. A full /dev/shm would then be a SIGBUS at that write, so
    the free space is checked first (an OSError here instead; another process filling /dev/shm in
    between is not guarded against).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _own_file(fd, path)
        have = os.fstat(fd).st_size
        if have != size:
            vfs = os.fstatvfs(fd)
            if size - have > vfs.f_bavail * vfs.f_frsize:
                raise OSError(errno.ENOSPC, f"{size} bytes do not fit in {path.parent}")
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


@dataclass
class Restored:
    """What :meth:`MemoryCheckpointer.restore` hands back: the step, this rank's saved trees, where
    each rank's state came from ({rank: 'memory' | 'peer <holder>'}) and the seconds it took."""

    step: int
    app: dict[str, Any]
    rank_state: dict[str, Any]
    sources: dict[int, str]
    seconds: float


def read_snapshot(meta: dict[str, Any], data: torch.Tensor) -> dict[str, Any]:
    """The trees of a snapshot from its description and its data bytes (tensors are views of them)."""
    views = [_view(data, entry) for entry in meta["layout"]]
    return {
        "step": meta["step"],
        "world_size": meta["world_size"],
        "app": _rebuild(meta["tree"], views),
        "rank_state": meta["rank_state"],
    }


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
        if jobs is me._jobs:
            me._copy_job(*job)
        else:
            me._background(*job)
        del me


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
    ) -> None:
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
        self._layout: list[tuple[int, int, str, list[int]]] = []
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # slot -> (store, views)
        self._error: BaseException | None = None
        self.stalls: list[float] = []
        self.copy_waits: dict[int, float] = {}  # snapshot step -> wait before the next update
        self._copied: tuple[int, threading.Event] | None = None
        self.warnings: list[str] = []  # snapshots not written (the run goes on); the trainer reports them
        self.last_background_s = 0.0
        self.last_verify_s = 0.0  # seconds the last restore spent checking SHA-256 (part of its time)

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
            store = _map(self.holder_dir / data_name(owner, slot), size)
            self._stores[(owner, slot)] = store
        return store

    def _write_meta(self, h: Holding, doc: dict[str, Any]) -> Path:
        path = self.holder_dir / snapshot_name(h)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.unlink(missing_ok=True)  # left by a rank killed while writing it
        try:
            with open(tmp, "xb", opener=_no_follow) as fh:  # "x": O_CREAT | O_EXCL
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
        tensors: list[torch.Tensor] = []
        tree = _flatten(app_state, tensors)
        local = [_plain(t) for t in tensors]
        key = tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in local)
        if key != self._key:  # another model, or tensors reallocated: lay the data file out anew
            self._layout = _plan(local)
            self._key = key
            self._views.clear()
        layout = self._layout
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
            store = self._store(self.rank, slot, _total(layout))
        except OSError as exc:  # /dev/shm full, say: no snapshot here this step, training goes on
            self.warnings.append(f"step {step}: rank {self.rank} could not write its snapshot: {exc}")
        else:
            cached = self._views.get(slot)
            if cached is None or cached[0] is not store:
                cached = (store, [_view(store, entry) for entry in layout])
                self._views[slot] = cached
            views = cached[1]
            later = defer if isinstance(defer, (set, frozenset)) else set(defer)
            for i, (src, dst) in enumerate(zip(local, views, strict=True)):
                if src.device.type == "cuda":
                    pinned = self._staging.get(i)
                    if pinned is None or pinned.shape != src.shape or pinned.dtype != src.dtype:
                        pinned = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
                        self._staging[i] = pinned
                    pinned.copy_(src, non_blocking=True)
                    staged.append((dst, pinned))
                elif src.data_ptr() in later:
                    deferred.append((dst, src))  # copied by the background thread, first thing
                else:
                    dst.copy_(src)
            host = _host(tree, tensors, views) if persist else {}
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
            "rank_state": _copied(rank_state),
        }
        if not self._workers:
            # The workers hold this object weakly between jobs, and are ended when it is
            # collected unclosed (a crashed run): its mapped files are then released.
            me = weakref.ref(self)
            self._workers = [
                threading.Thread(target=_serve, args=(me, q), name=f"gpuyard-snapshot-{name}", daemon=True)
                for q, name in ((self._jobs, "copy"), (self._slow, "write"))
            ]
            # (also at interpreter exit: ended and joined before the interpreter goes down, not
            # left running into its finalization)
            weakref.finalize(self, _stop, (self._jobs, self._slow), list(self._workers))
            for worker in self._workers:
                worker.start()
        self._done = threading.Event()
        self._jobs.put(
            (step, slot, host, doc, dict(meta), persist, event, deferred, staged, copied, self._done)
        )
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        return stall

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
                doc[HASH] = _digest(self._stores[(self.rank, slot)])  # checked before any restore
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
                        self._store(self.rank, 1 - slot, own.numel()).zero_()
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
        received = torch.load(io.BytesIO(_bytes_of(meta_in)), weights_only=True)
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
        step that follows it); returns the seconds waited, also kept in ``copy_waits[step]``."""
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
            _own_file(fh.fileno(), meta_path)
            meta = torch.load(fh, weights_only=True)
        path = self.holder_dir / data_name(h.owner, h.slot)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            _own_file(fd, path)
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
            elif data.numel() < _total(meta["layout"]) or _digest(data) != want:
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
                    torch.load(io.BytesIO(_bytes_of(meta_bytes)), weights_only=True), self._recv(holder)
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
        _stop((self._jobs, self._slow), self._workers)
        self._workers = []
        self._stores.clear()
        self._views.clear()
        shutil.rmtree(self.holder_dir, ignore_errors=True)
