"""Callbacks and losses named by the multiproc test specs (imported by torchrun workers via PYTHONPATH).

They act only when the test asks through environment variables, so one spec serves the reference
run and the interrupted runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HOOK_DIR = "GPUYARD_TEST_HOOK_DIR"
HOOK_MODE = "GPUYARD_TEST_HOOK_MODE"  # kill | term
HOOK_STEP = "GPUYARD_TEST_HOOK_STEP"


def _armed(trainer: Any, event: str, rank: int) -> Path | None:
    # Only in the first attempt: after a restart the job must run through.
    if event != "step" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    if trainer.ctx.rank != rank or trainer.step != int(os.environ.get(HOOK_STEP, "-1")):
        return None
    return Path(os.environ[HOOK_DIR])


def block_for_kill(trainer: Any, event: str) -> None:
    """Rank 1 publishes its pid at the hook step and waits there to be SIGKILLed by the test."""
    if os.environ.get(HOOK_MODE) != "kill" or (folder := _armed(trainer, event, rank=1)) is None:
        return
    tmp = folder / "victim.pid.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(folder / "victim.pid")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the test kills this process; the deadline bounds a failure
        time.sleep(0.05)
    raise RuntimeError("block_for_kill: nobody killed this rank within 120 s")


def wait_for_sigterm(trainer: Any, event: str) -> None:
    """Rank 0 publishes 'ready' at the hook step, then waits until SIGTERM has set the stop flag."""
    if os.environ.get(HOOK_MODE) != "term" or (folder := _armed(trainer, event, rank=0)) is None:
        return
    (folder / "ready").write_text(str(trainer.step))
    deadline = time.monotonic() + 120
    while not trainer.stop_requested and time.monotonic() < deadline:
        time.sleep(0.05)


_calls = {"n": 0}


def nan_after_10(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy that turns NaN from the 11th call on (a diverging run)."""
    _calls["n"] += 1
    loss = F.cross_entropy(outputs, targets)
    return loss * float("nan") if _calls["n"] > 10 else loss


def fill_disk(trainer: Any, event: str) -> None:
    """Rank 0 fills the run folder's disk at step GPUYARD_TEST_HOOK_FILL, leaving 12 KiB: room for a
    few metrics lines, none for the next checkpoint (five files of at least one 4 KiB page each)."""
    at = os.environ.get("GPUYARD_TEST_HOOK_FILL")
    if event != "step" or at is None or trainer.ctx.rank != 0 or trainer.step != int(at):
        return
    filler = trainer.run_dir / "filler.bin"
    with open(filler, "wb", buffering=0) as fh:  # unbuffered: nothing left to fail at close
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - 12288))
