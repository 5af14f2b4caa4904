"""Atomic, sharded checkpoints with torch.distributed.checkpoint; keeps the last K; optional async save.

Layout of a run's checkpoint folder::

    checkpoints/
      step-000000120/          complete: has COMPLETE.json
        .metadata  __0_0.distcp ...   model + optimizer shards (DCP)
        rank0.pt rank1.pt      per-rank state: counters, LR schedule, RNG, data position
        COMPLETE.json          written last, before the rename
      .tmp-step-000000140/     being written (or abandoned by a crash): never loaded

A checkpoint is written into ``.tmp-*``; once every rank's shards are on disk, rank 0 writes the
marker and renames the folder. A reader only considers folders with the marker, so a checkpoint
cut short by SIGKILL is never loaded. The folder must be on a filesystem all ranks share.
"""

from __future__ import annotations

import contextlib
import json
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
    """The metadata rank 0 wrote when the checkpoint became complete."""
    return dict(json.loads((Path(path) / MARKER).read_text()))


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
        self._pending: tuple[Future[Any], Path, dict[str, Any]] | None = None
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
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier(group)
        torch.save(rank_state, tmp / f"rank{self.rank}.pt")
        dcp = _dcp()
        if self.async_save and not background:
            with _quiet_single_process():
                future = dcp.async_save(
                    app_state, checkpoint_id=str(tmp), process_group=self._group, no_dist=_no_dist()
                )
            self._pending = (future, tmp, {"step": step, **meta})  # type: ignore[assignment]
        else:
            with _quiet_single_process():
                dcp.save(app_state, checkpoint_id=str(tmp), process_group=group, no_dist=_no_dist())
            self._finalize(tmp, {"step": step, **meta}, group)
        return final

    def wait(self) -> None:
        """Finish a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, meta = self._pending
        self._pending = None
        result = future.result()
        # Newer torch returns a response object whose upload future completes the write.
        upload = getattr(result, "upload_completion", None)
        if upload is not None:
            upload.result()
        self._finalize(tmp, meta)

    def _finalize(self, tmp: Path, meta: dict[str, Any], group: Any = None) -> None:
        # dcp.save returns on rank 0 only after every rank's shards are written and .metadata is
        # saved; the barrier makes the per-rank files (written before it) visible too.
        _barrier(group)
        if self.rank == 0:
            final = self.root / tmp.name[len(_TMP) :]
            (tmp / MARKER).write_text(json.dumps({**meta, "time": time.time()}))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in list_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier(group)

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
