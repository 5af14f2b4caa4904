"""In-memory checkpoints: a host-memory snapshot every N steps, a replica on the next rank, storage every M.

What happens at a snapshot step (every rank, ``checkpoint.memory_every``):

1. **In the training thread** (the only stall): the model and optimizer tensors are copied into
   host buffers allocated once and reused (pinned, non-blocking device-to-host copies on CUDA; the
   copy is stream-ordered, so the next optimizer step cannot overtake it), plus this rank's small
   state (counters, LR schedule, RNG, data position).
2. **In a background thread**: the host copy is serialised into this rank's folder under the node's
   snapshot folder (``$GPUYARD_SNAPSHOT_DIR/holder-<rank>/``; ``/dev/shm``, so host memory), sent to
   rank ``(r + 1) % world`` over a gloo side group (isend/irecv of a byte tensor), which keeps it as
   a replica in its own folder; every ``checkpoint.persist_every`` steps the same host copy is also
   written to storage as an ordinary checkpoint (``dcp.save`` on the side group, then the marker
   and rename of :class:`~gpuyard.train.checkpoint.Checkpointer`). The next snapshot, a storage
   checkpoint and the end of the run wait for it first.

The snapshot folder belongs to the node's launcher (``gpuyard train`` creates it, hands it to every
rank through ``GPUYARD_SNAPSHOT_DIR`` and removes it when torchrun exits), so it outlives a killed
rank and torchrun's restart of the worker group. On restart every rank lists what it holds (its own
snapshots and the replicas it keeps), the ranks agree on the newest step every rank can get (from its
own folder, else from the rank holding its replica) and restore from memory when that step is not
older than the newest storage checkpoint; otherwise they resume from storage as before.
Files are written to a temporary name and renamed, and the last two snapshot steps are kept, so a
rank killed halfway through a snapshot leaves the previous step complete everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import io
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.train.checkpoint import Checkpointer

SNAPSHOT_DIR_ENV = "GPUYARD_SNAPSHOT_DIR"
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
    """One snapshot file a rank holds: whose state (`owner`), at which step, for which world size."""

    owner: int
    step: int
    world_size: int


def snapshot_name(h: Holding) -> str:
    """File name of a snapshot (owner, step and world size are read back from it)."""
    return f"o{h.owner}-s{h.step:09d}-w{h.world_size}{_SUFFIX}"


def parse_name(name: str) -> Holding | None:
    """The holding a snapshot file name describes, or None for anything else (temporary files)."""
    if not name.endswith(_SUFFIX) or not name.startswith("o"):
        return None
    try:
        owner, step, world = name[: -len(_SUFFIX)].split("-")
        return Holding(int(owner[1:]), int(step[1:]), int(world[1:]))
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


def _plain(tree: Any) -> Any:
    """The tree with DTensors replaced by their local shards (what a snapshot file holds)."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return local_tensor(tree)
    return tree


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


def _write_atomic(path: Path, data: memoryview | bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


@dataclass
class Restored:
    """What :meth:`MemoryCheckpointer.restore` hands back: the step, this rank's saved trees, where
    each rank's state came from ({rank: 'memory' | 'peer <holder>'}) and the seconds it took."""

    step: int
    app: dict[str, Any]
    rank_state: dict[str, Any]
    sources: dict[int, str]
    seconds: float


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
        self.holder_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer = checkpointer
        self._group: Any = None
        if dist.is_available() and dist.is_initialized():
            # Replica exchange and background persists run their own collectives: a separate gloo
            # group keeps them from interleaving with the training collectives (and works on CPU
            # tensors whatever the training backend is).
            self._group = dist.new_group(backend="gloo")
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._from_cuda = False
        self.stalls: list[float] = []
        self.copy_waits: dict[int, float] = {}  # snapshot step -> wait before the next update
        self._copied: tuple[int, threading.Event] | None = None
        self._defer: set[int] = set()
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.warnings: list[str] = []  # snapshots not written (the run goes on); the trainer reports them
        self.last_background_s = 0.0

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
        """Copy the state to host memory and hand the rest to a background thread (collective).

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
        self._from_cuda = False
        self._defer = set(defer)
        self._deferred = []
        host = self._copy(app_state, "")
        copied = threading.Event()
        if not self._deferred:
            copied.set()
        self._copied = (step, copied)
        event = None
        if self._from_cuda:
            # The copies are queued on the current stream, ahead of the next step's kernels; the
            # background thread waits for this event before reading the buffers.
            event = torch.cuda.Event()
            event.record()
        small = copy.deepcopy(rank_state)
        self._thread = threading.Thread(
            target=self._background,
            args=(step, host, small, dict(meta), persist, event, self._deferred, copied),
            name=f"gpuyard-snapshot-{step}",
            daemon=True,
        )
        self._thread.start()
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        return stall

    def _copy(self, tree: Any, path: str) -> Any:
        if isinstance(tree, dict):
            return {k: self._copy(v, f"{path}/{k}") for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(v, f"{path}/{i}") for i, v in enumerate(tree))
        if not isinstance(tree, torch.Tensor):
            return copy.deepcopy(tree)
        src = local_tensor(tree).detach()
        self._from_cuda = self._from_cuda or src.device.type == "cuda"
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        if src.device.type == "cpu" and src.data_ptr() in self._defer:
            self._deferred.append((buf, src))  # copied by the background thread, first thing
        else:
            buf.copy_(src, non_blocking=src.device.type == "cuda")
        from torch.distributed.tensor import DTensor

        if not isinstance(tree, DTensor):
            return buf
        # Keep the sharding so a persisted checkpoint is the same DCP layout as a direct save.
        return DTensor.from_local(
            buf, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape, stride=tree.stride()
        )

    def _background(
        self,
        step: int,
        host: dict[str, Any],
        rank_state: dict[str, Any],
        meta: dict[str, Any],
        persist: bool,
        event: Any,
        deferred: list[tuple[torch.Tensor, torch.Tensor]],
        copied: threading.Event,
    ) -> None:
        start = time.perf_counter()
        try:
            try:
                for buf, src in deferred:
                    buf.copy_(src)
            finally:
                copied.set()  # the optimizer step may go on (an error is raised at wait())
            # The rest is not waited for by the next step: let training have the CPU first.
            _lower_priority()
            if event is not None:
                event.synchronize()
            own = self._write_own(step, host, rank_state)
            if self._group is not None and self.world_size > 1:
                self._share(step, own)
            self._prune()
            if persist and self.checkpointer is not None:
                self.checkpointer.save(step, host, rank_state, meta, group=self._group, background=True)
        except BaseException as exc:  # handed to the training thread at the next wait()
            self._error = exc
        finally:
            self.last_background_s = time.perf_counter() - start

    def _write_own(self, step: int, host: dict[str, Any], rank_state: dict[str, Any]) -> Path | None:
        """This rank's snapshot file, or None when it could not be written (/dev/shm full, say):
        that step then has no snapshot here, and training goes on."""
        own = self.holder_dir / snapshot_name(Holding(self.rank, step, self.world_size))
        tmp = own.with_name(f".tmp-{own.name}")
        doc = {"step": step, "world_size": self.world_size, "app": _plain(host), "rank_state": rank_state}
        try:
            torch.save(doc, tmp)  # straight into /dev/shm (one copy); renamed once whole
            tmp.replace(own)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.warnings.append(f"step {step}: rank {self.rank} could not write its snapshot: {exc}")
            return None
        return own

    def _share(self, step: int, own: Path | None) -> None:
        """Send this rank's snapshot to the next rank, keep the previous rank's. A rank without a
        snapshot takes part all the same (an empty one), or the next rank would wait for it."""
        with contextlib.ExitStack() as stack:
            data = memoryview(b"")
            if own is not None:
                f = stack.enter_context(open(own, "rb"))
                data = memoryview(stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)))
            incoming = self._exchange(data)
            del data
        prev = (self.rank - 1) % self.world_size
        replica = self.holder_dir / snapshot_name(Holding(prev, step, self.world_size))
        try:
            if len(incoming):
                _write_atomic(replica, incoming)
        except OSError as exc:
            replica.with_name(f".tmp-{replica.name}").unlink(missing_ok=True)
            self.warnings.append(f"step {step}: rank {self.rank} could not keep rank {prev}'s replica: {exc}")

    def _exchange(self, data: memoryview) -> memoryview:
        """Send this rank's snapshot to the next rank and receive the previous rank's."""
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        size_out = torch.tensor([len(data)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        _wait_all(dist.isend(size_out, nxt, group=self._group), dist.irecv(size_in, prev, group=self._group))
        incoming = torch.empty(int(size_in.item()), dtype=torch.uint8)
        # An empty snapshot (not written) is announced by its size and not sent.
        send = (
            dist.isend(torch.frombuffer(data, dtype=torch.uint8), nxt, group=self._group)
            if len(data)
            else None
        )
        recv = dist.irecv(incoming, prev, group=self._group) if incoming.numel() else None
        _wait_all(send, recv)
        return _bytes_of(incoming)

    def _prune(self) -> None:
        held = [(h, p) for p in self.holder_dir.iterdir() if (h := parse_name(p.name)) is not None]
        keep = sorted({h.step for h, _ in held}, reverse=True)[:KEEP_STEPS]
        for h, p in held:
            if h.step not in keep:
                p.unlink(missing_ok=True)

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
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"in-memory checkpoint: background work failed: {error}") from error

    # ----- getting it back ----------------------------------------------------------------------
    def inventory(self) -> list[Holding]:
        """The complete snapshots this rank holds (its own and the replicas it keeps)."""
        if not self.holder_dir.is_dir():
            return []
        return sorted(h for p in self.holder_dir.iterdir() if (h := parse_name(p.name)) is not None)

    def restore(self, storage_step: int) -> Restored | None:
        """Agree on a snapshot step and load this rank's state from memory (collective).

        Args:
            storage_step: the newest complete storage checkpoint's step (-1: none).

        Returns:
            The restored trees (plain tensors; :func:`fill` them into the live state), or None
            when no snapshot step is held for every rank at or after `storage_step`.
        """
        start = time.perf_counter()
        mine = self.inventory()
        if self._group is not None and self.world_size > 1:
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self._group)
        else:
            everyone = [mine]
        plan = plan_restore(everyone, self.world_size, storage_step)
        if plan is None:
            return None
        step, holders = plan
        doc: dict[str, Any] | None = None
        for owner in range(self.world_size):
            holder = holders[owner]
            path = self.holder_dir / snapshot_name(Holding(owner, step, self.world_size))
            if holder == owner:
                if owner == self.rank:
                    # Mapped, not read: the tensors are views of the /dev/shm pages until fill() copies.
                    doc = torch.load(path, mmap=True, weights_only=True)
            elif self.rank == holder:
                self._send(path.read_bytes(), owner)
            elif self.rank == owner:
                doc = torch.load(io.BytesIO(self._recv(holder)), weights_only=True)
        if doc is None:
            raise RuntimeError(f"in-memory checkpoint: rank {self.rank} got no snapshot of step {step}")
        sources = {o: "memory" if h == o else f"peer {h}" for o, h in holders.items()}
        return Restored(step, doc["app"], doc["rank_state"], sources, time.perf_counter() - start)

    def _send(self, data: bytes, to: int) -> None:
        dist.send(torch.tensor([len(data)], dtype=torch.int64), to, group=self._group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), to, group=self._group)

    def _recv(self, source: int) -> memoryview:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, source, group=self._group)
        out = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(out, source, group=self._group)
        return _bytes_of(out)

    def close(self) -> None:
        """Wait for background work and drop this rank's snapshots (the run ended cleanly)."""
        self.wait()
        shutil.rmtree(self.holder_dir, ignore_errors=True)
