"""Faults for the chaos test (imported by torchrun workers via PYTHONPATH); each acts only when the
test's environment asks for it, so the undisturbed reference run uses the same spec.

* ``GPUYARD_CHAOS_SLOW_RANK``: that rank's loss sleeps ``GPUYARD_CHAOS_SLOW_S`` per micro-batch, in
  every attempt (the injected slowness is the subject of the test, not a wait for a condition);
* ``GPUYARD_CHAOS_STOP_RANK`` / ``_STOP_STEP``: in the first attempt that rank publishes its pid at
  that step (``stall.pid``) and carries on; the test SIGSTOPs it and SIGCONTs it later;
* ``GPUYARD_CHAOS_KILL_RANK`` / ``_KILL_STEP``: in the first attempt that rank publishes its pid at
  that step (``victim.pid``) and waits there for the test's SIGKILL.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DIR = "GPUYARD_TEST_HOOK_DIR"


def _env_int(name: str) -> int:
    return int(os.environ.get(f"GPUYARD_CHAOS_{name}", "-1"))


def slow_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if os.environ.get("RANK") == str(_env_int("SLOW_RANK")):
        time.sleep(float(os.environ.get("GPUYARD_CHAOS_SLOW_S", "0.05")))
    return F.cross_entropy(outputs, targets)


def _publish(name: str) -> None:
    folder = Path(os.environ[DIR])
    tmp = folder / f"{name}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(folder / name)


def faults(trainer: Any, event: str) -> None:
    if event != "step" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, step = trainer.ctx.rank, trainer.step
    if rank == _env_int("STOP_RANK") and step == _env_int("STOP_STEP"):
        _publish("stall.pid")
    if rank == _env_int("KILL_RANK") and step == _env_int("KILL_STEP"):
        _publish("victim.pid")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the test kills this process; the deadline bounds a failure
            time.sleep(0.05)
        raise RuntimeError("chaos faults: nobody killed this rank within 120 s")
