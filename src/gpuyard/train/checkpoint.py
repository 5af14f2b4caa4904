"""Atomic, sharded checkpoints with torch.distributed.checkpoint; keeps the last K; optional async save.

Layout of a run's checkpoint folder::

    checkpoints/
      step-000000120/          complete: has COMPLETE.json
        .metadata  __0_0.distcp ...   model + optimizer shards (DCP)
        rank0.pt rank1.pt      per-rank state: counters, LR schedule, RNG, data position
        COMPLETE.json          written last, before the rename: the step, and the size and
                               SHA-256 of every other file of the folder
      .tmp-step-000000140/     being written (or abandoned by a crash): never loaded
      corrupt-step-000000100/  failed its check at load: set aside (never deleted, never loaded)

A checkpoint is written into ``.tmp-*``; once every rank's shards are on disk, the ranks hash the
files (each a share of them), rank 0 writes the marker with the hashes and renames the folder. A
reader only considers folders with the marker, so a checkpoint cut short by SIGKILL is never
loaded, and checks the sizes and hashes before loading (:func:`verify_checkpoint`): a folder that
fails is renamed ``corrupt-*`` (:func:`set_aside`) and the previous one is tried. A save that fails
on any rank fails on every rank (:class:`CheckpointSaveError`, which says whether the disk was
full) and its ``.tmp-*`` folder is removed. The folder must be on a filesystem all ranks share.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.errors import IntegrityError

MARKER = "COMPLETE.json"
_PREFIX = "step-"
_TMP = ".tmp-"
ASIDE = "corrupt-"  # a checkpoint that failed its check, renamed (never loaded, never deleted)
HASH = "sha256"  # hashlib name; faster than blake2b where the CPU has SHA extensions (BENCHMARKS.md)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; raised on every rank (the ranks agree on it).

    Attributes:
        step: the step being saved. path: the checkpoint folder when the disk is full, else the
            save's temporary folder.
        disk_full: the disk (or quota) was full: a restart would fail the same way.
    """

    def __init__(self, step: int, path: str, message: str, disk_full: bool) -> None:
        self.step, self.path, self.disk_full = step, path, disk_full
        what = f"disk full at {path}" if disk_full else f"{message} ({path})"
        super().__init__(f"checkpoint of step {step} not written: {what}")
        self.reason = f"disk full at {path}" if disk_full else message


class DiskFullError(RuntimeError):
    """Training stopped because a write found the disk (or quota) full outside a checkpoint save
    (metrics.jsonl, status files): a restart would fail the same way. Same attributes as
    :class:`CheckpointSaveError`."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path, self.disk_full = step, path, True
        self.reason = f"disk full at {path}"
        super().__init__(f"training stopped at step {step}: {self.reason}")


def file_digest(path: str | Path) -> str:
    """Hex digest (:data:`HASH`) of a file's content."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, HASH).hexdigest()


def _hash_share(folder: Path, names: list[str], rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Size and digest of every `world`-th file of `names` from `rank` on (each rank hashes a share)."""
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        if i % world == rank:
            path = folder / name
            out[name] = {"size": path.stat().st_size, HASH: file_digest(path)}
    return out


def _content_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != MARKER and p.is_file())


def verify_checkpoint(path: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """Check this rank's share (every `world`-th file) of a complete checkpoint against its marker.

    Returns:
        None when the share is intact (or the checkpoint predates hashes: see :func:`has_hashes`);
        otherwise what is wrong, in a few words naming the file.
    """
    path = Path(path)
    try:
        marker = read_marker(path)
    except (OSError, ValueError) as exc:
        return f"{MARKER} unreadable ({exc})"
    files = marker.get("files")
    if files is None:
        return None
    if not isinstance(files, dict) or not files:
        return f"{MARKER} has no list of files"
    names = sorted(files)
    if rank == 0:
        try:
            unlisted = sorted(set(_content_files(path)) - set(names))
        except OSError as exc:
            return f"folder unreadable ({exc})"
        if unlisted:
            return f"{unlisted[0]} is not one of the files the checkpoint was written with"
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        want = files[name]
        if "/" in name or name in ("", ".", "..") or not isinstance(want, dict):
            return f"{MARKER} lists {name!r}, not a file of the folder"
        file = path / name
        try:
            size = file.stat().st_size
            if size != want.get("size"):
                return f"{name} has {size} bytes, written with {want.get('size')} (truncated or replaced)"
            if file_digest(file) != want.get(HASH):
                return f"{name} does not match its {HASH} (its content changed after the save)"
        except OSError as exc:
            return f"{name} unreadable ({exc.strerror or exc})"
    return None


def has_hashes(path: str | Path) -> bool:
    """Whether a checkpoint's marker carries the hashes of its files (older checkpoints do not)."""
    try:
        return isinstance(read_marker(path).get("files"), dict)
    except (OSError, ValueError):
        return False


def set_aside(path: str | Path) -> Path:
    """Rename a checkpoint that failed its check to ``corrupt-<name>`` (``-2``... if taken); returns
    the new path. It is kept for inspection and never listed or loaded again."""
    path = Path(path)
    target = path.with_name(f"{ASIDE}{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{ASIDE}{path.name}-{n}")
    path.rename(target)
    return target


def step_of(path: str | Path) -> int:
    """The step of a checkpoint folder (``step-000000120`` -> 120)."""
    name = Path(path).name
    return int(name[name.index(_PREFIX) + len(_PREFIX) :].split("-")[0])


def is_disk_full(exc: BaseException, folder: str | Path) -> bool:
    """Whether an error of a save means the disk (or quota) is full: an ENOSPC/EDQUOT anywhere in
    its causes (DCP wraps each rank's failure), or torch's zip writer failing ("unexpected pos",
    "file write failed", which carry no errno) while `folder`'s filesystem has under 1 MiB free."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    vague = False
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e) if not hasattr(e, "failures") else ""
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        vague = vague or "unexpected pos" in text or "file write failed" in text
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        stack.extend([e.__cause__, e.__context__])
    if not vague:
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


def _group_rank_world(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (all_gather_object over `group`); [obj] without a process group."""
    _, world = _group_rank_world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def step_dirname(step: int) -> str:
    """Folder name for a checkpoint at optimizer step `step` (sorts by step)."""
    return f"{_PREFIX}{step:09d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (folders without the marker are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_marker(path: str | Path) -> dict[str, Any]:
    """The metadata rank 0 wrote when the checkpoint became complete.

    Raises:
        OSError: unreadable; ValueError: not a JSON object (a damaged marker).
    """
    doc = json.loads((Path(path) / MARKER).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{MARKER} is not a JSON object")
    return doc


def optimizer_groups(path: str | Path, key: str) -> int | None:
    """How many optimizer parameter groups the checkpoint at ``path`` holds under ``key`` (None when its
    metadata cannot tell: the load then reports what is wrong)."""
    try:
        meta = _dcp().FileSystemReader(str(path)).read_metadata()
    except Exception:  # unreadable metadata: the load itself says so, in its words
        return None
    prefix = f"{key}.param_groups."
    found = {
        name[len(prefix) :].split(".", 1)[0] for name in meta.state_dict_metadata if name.startswith(prefix)
    }
    return len(found) if found else None


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported when first used: the launcher lists and reads
    checkpoint markers without paying for it (0.7 s: it pulls in DTensor and sympy)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _no_dist() -> bool:
    # A single process without a process group: say so, rather than let DCP warn and guess.
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call that it "assumes" a single process; here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group: Any = None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


class Checkpointer:
    """Saves and loads checkpoints of one run; every rank calls every method (they are collective)."""

    def __init__(self, root: str | Path, keep: int, rank: int = 0, async_save: bool = False) -> None:
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.async_save = async_save
        self._pending: tuple[Future[Any], Path, dict[str, Any], BaseException | None] | None = None
        self._group = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{_TMP}*"):  # abandoned by a killed attempt
                shutil.rmtree(stale, ignore_errors=True)
        if async_save and dist.is_initialized():
            # The background save runs its own collectives: a separate gloo group keeps them from
            # interleaving with the training collectives of the main thread.
            self._group = dist.new_group(backend="gloo")
        _barrier()

    def save(
        self,
        step: int,
        app_state: dict[str, Any],
        rank_state: dict[str, Any],
        meta: dict[str, Any],
        group: Any = None,
        background: bool = False,
    ) -> Path:
        """Write a checkpoint for `step`; returns its final folder (complete once this returns, or once
        the next save/`wait()` returns when saving asynchronously).

        Args:
            step: optimizer step the state belongs to.
            app_state: DCP state dict (model and optimizer, possibly sharded).
            rank_state: this rank's small state (torch.save'd; tensors, numbers, lists, dicts).
            meta: JSON-able facts written into the marker.
            group: the process group of its collectives (default: the default group).
            background: called from a background thread with a `group` of its own (in-memory
                checkpoints): always synchronous there, whatever `async_save` says.
        """
        if not background:
            self.wait()
        final = self.root / step_dirname(step)
        if (final / MARKER).is_file():
            return final  # already saved at this step (e.g. epoch end then stop at the same step)
        tmp = self.root / f"{_TMP}{step_dirname(step)}"
        made: BaseException | None = None
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as exc:
                made = exc
        self._agree(step, tmp, made, group)  # (the barrier before anyone writes into it)
        written: BaseException | None = None
        try:
            torch.save(rank_state, tmp / f"rank{self.rank}.pt")
        except (OSError, RuntimeError) as exc:  # ENOSPC, or torch's zip writer failing on it
            written = exc
        dcp = _dcp()
        try:
            if self.async_save and not background:
                with _quiet_single_process():
                    future = dcp.async_save(
                        app_state, checkpoint_id=str(tmp), process_group=self._group, no_dist=_no_dist()
                    )
                self._pending = (future, tmp, {"step": step, **meta}, written)  # type: ignore[assignment]
                return final
            with _quiet_single_process():
                dcp.save(app_state, checkpoint_id=str(tmp), process_group=group, no_dist=_no_dist())
        except BaseException as exc:  # DCP raises on every rank when any rank failed (CheckpointException)
            self._fail(step, tmp, exc)
        self._finalize(tmp, {"step": step, **meta}, group, written)
        return final

    def _fail(self, step: int, tmp: Path, exc: BaseException) -> None:
        """Remove the temporary folder and raise the save's error (every rank calls it)."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointSaveError):
            raise exc
        full = is_disk_full(exc, self.root)
        where = str(self.root) if full else str(tmp)  # the folder on the full disk (tmp is gone)
        first = str(exc).strip().splitlines()
        raise CheckpointSaveError(step, where, first[0] if first else type(exc).__name__, full) from exc

    def _agree(self, step: int, tmp: Path, error: BaseException | None, group: Any = None) -> None:
        """Collective: raise CheckpointSaveError on every rank when any rank had an `error`
        (the first one, with whether it was a full disk), after removing `tmp`."""
        mine = None
        if error is not None:
            first = str(error).strip().splitlines()
            mine = (
                first[0] if first else type(error).__name__,
                is_disk_full(error, self.root),
                str(self.root),
            )
        failed = [f for f in gather(mine, group) if f is not None]
        if not failed:
            return
        message, full, where = next((f for f in failed if f[1]), failed[0])
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(step, where if full else str(tmp), message, full) from error

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, meta, written = self._pending  # type: ignore[misc]
        self._pending = None
        try:
            result = future.result()
            # Newer torch returns a response object whose upload future completes the write.
            upload = getattr(result, "upload_completion", None)
            if upload is not None:
                upload.result()
        except BaseException as exc:
            self._fail(int(meta["step"]), tmp, exc)
        self._finalize(tmp, meta, None, written)

    def _finalize(
        self, tmp: Path, meta: dict[str, Any], group: Any = None, written: BaseException | None = None
    ) -> None:
        # dcp.save returns on every rank only after every rank's shards and .metadata are written
        # (its last step is collective), and the per-rank files were written before it: every rank
        # lists the same files. Each hashes a share; rank 0 writes them into the marker.
        step = int(meta["step"])
        rank, world = _group_rank_world(group)
        share: dict[str, dict[str, Any]] = {}
        error = written
        if error is None:
            try:
                share = _hash_share(tmp, _content_files(tmp), rank, world)
            except OSError as exc:
                error = exc
        self._agree(step, tmp, error, group)
        shares = gather(share, group)
        done: BaseException | None = None
        if self.rank == 0:
            files: dict[str, dict[str, Any]] = {}
            for part in shares:
                files.update(part)
            try:
                for name in _content_files(tmp):  # any file no rank saw (a slow shared filesystem)
                    if name not in files:
                        files[name] = _hash_share(tmp, [name], 0, 1)[name]
                doc = {**meta, "time": time.time(), "hash": HASH, "files": files}
                (tmp / MARKER).write_text(json.dumps(doc))
                final = self.root / tmp.name[len(_TMP) :]
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
            except OSError as exc:
                done = exc
            else:
                for old in list_checkpoints(self.root)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        self._agree(step, tmp, done, group)

    def load(self, path: str | Path, app_state: dict[str, Any]) -> dict[str, Any]:
        """Load shards into `app_state` in place and return this rank's small state.

        Raises:
            IntegrityError: when the folder is not a complete checkpoint.
        """
        path = Path(path)
        if not (path / MARKER).is_file():
            raise IntegrityError(f"{path}: not a complete checkpoint (no {MARKER})")
        with _quiet_single_process():
            _dcp().load(app_state, checkpoint_id=str(path), no_dist=_no_dist())
        own = path / f"rank{self.rank}.pt"
        # A different world size on restart (elastic): fall back to rank 0's counters and schedule.
        source = own if own.is_file() else path / "rank0.pt"
        return dict(torch.load(source, weights_only=True))
