"""Callbacks for the in-memory checkpoint tests (imported by torchrun workers via PYTHONPATH).

They act only when the test asks through environment variables (see hooks.py for the shared ones).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

HOOK_DIR = "GPUYARD_TEST_HOOK_DIR"
HOOK_MODE = "GPUYARD_TEST_HOOK_MODE"  # kill | lose_node
HOOK_STEP = "GPUYARD_TEST_HOOK_STEP"


def kill_rank1(trainer: Any, event: str) -> None:
    """At the hook step of the first attempt, rank 1 lets its last snapshot's background work (its
    replica exchange) finish, in lose_node mode also deletes what its node held in memory, then
    publishes its pid and waits to be SIGKILLed by the test."""
    mode = os.environ.get(HOOK_MODE)
    if mode not in ("kill", "lose_node") or event != "step" or trainer.ctx.rank != 1:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if trainer.step != int(os.environ.get(HOOK_STEP, "-1")):
        return
    folder = Path(os.environ[HOOK_DIR])
    trainer.memory.wait()
    if mode == "lose_node":
        shutil.rmtree(trainer.memory.holder_dir)
    (folder / "snapshot_dir").write_text(str(trainer.memory.folder))
    tmp = folder / "victim.pid.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(folder / "victim.pid")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the test kills this process; the deadline bounds a failure
        time.sleep(0.05)
    raise RuntimeError("kill_rank1: nobody killed this rank within 120 s")
