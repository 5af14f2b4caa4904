"""Where in-memory snapshots live: their file names, the restore plan, private folders and mapped files.

A holder's folder (``holder-<rank>/``, in /dev/shm) keeps, per owner, two data files
(:func:`data_name`) and a description per complete snapshot (:func:`snapshot_name`); see
:mod:`gpuyard.train.memory_checkpoint` for how they are written and read back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpuyard.errors import PermissionDenied
from gpuyard.train.checkpoint import HASH
from gpuyard.train.names import SNAPSHOT_DIR_ENV

KEEP_STEPS = 2  # snapshot steps kept per holder: a snapshot cut short leaves the previous one whole
SUFFIX = ".snap"


def default_snapshot_dir(run_dir: Path) -> Path:
    """Where snapshots go without a launcher: ``$GPUYARD_SNAPSHOT_DIR``, else a folder in /dev/shm
    (host memory) named after the run folder, else the temporary folder."""
    env = os.environ.get(SNAPSHOT_DIR_ENV)
    if env:
        return Path(env)
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
    return f"o{h.owner}-s{h.step:09d}-w{h.world_size}-g{h.slot}{SUFFIX}"


def data_name(owner: int, slot: int) -> str:
    """File name of one of an owner's two data files (the tensors, back to back, reused)."""
    return f"o{owner}-slot{slot}.bin"


def parse_name(name: str) -> Holding | None:
    """The holding a snapshot file name describes, or None for anything else (temporary files)."""
    if not name.endswith(SUFFIX) or not name.startswith("o"):
        return None
    try:
        owner, step, world, slot = name[: -len(SUFFIX)].split("-")
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


def bytes_of(t: torch.Tensor) -> memoryview:
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


def no_follow(path: str, flags: int) -> int:
    # An opener for open(): never through a link, and a new file readable by this user only.
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def own_file(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionDenied(f"{path}: not a file of this user (planted?): refused, never used")


def digest(data: torch.Tensor) -> str:
    # A uint8 CPU tensor (a mapped data file) hashed in place; hashlib releases the GIL while it runs.
    return hashlib.new(HASH, bytes_of(data)).hexdigest()


def map_file(path: Path, size: int) -> torch.Tensor:
    """A uint8 tensor over a /dev/shm file of `size` bytes (created or resized when needed).

    The file is sized, not filled: its pages are allocated when first written, by the background
    copy rather than the training thread. A full /dev/shm would then be a SIGBUS at that write, so
    the free space is checked first (an OSError here instead; another process filling /dev/shm in
    between is not guarded against).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        own_file(fd, path)
        have = os.fstat(fd).st_size
        if have != size:
            vfs = os.fstatvfs(fd)
            if size - have > vfs.f_bavail * vfs.f_frsize:
                raise OSError(errno.ENOSPC, f"{size} bytes do not fit in {path.parent}")
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def touch_pages(store: torch.Tensor) -> None:
    """Allocate a mapped file's pages now (one byte written per page: the kernel hands out zeroed
    pages), so that a later copy into it does not stop at every page. Only for a data file that no
    description refers to: the bytes written are not kept."""
    if store.numel():
        store[:: mmap.PAGESIZE].zero_()
