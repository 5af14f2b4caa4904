"""A callback for the tracking tests: rank 0 (the rank that writes to the database) waits to be SIGKILLed.

Imported by torchrun workers through PYTHONPATH (see conftest.env_for); acts only in the first attempt.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def rank0_block_for_kill(trainer: Any, event: str) -> None:
    """At GPUYARD_TEST_HOOK_STEP, rank 0 publishes its pid and waits there for the test's SIGKILL."""
    if event != "step" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if trainer.ctx.rank != 0 or trainer.step != int(os.environ.get("GPUYARD_TEST_HOOK_STEP", "-1")):
        return
    folder = Path(os.environ["GPUYARD_TEST_HOOK_DIR"])
    (folder / "rank0.pid.tmp").write_text(str(os.getpid()))
    (folder / "rank0.pid.tmp").rename(folder / "rank0.pid")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the test kills this process; the deadline bounds a failure
        time.sleep(0.05)
    raise RuntimeError("rank0_block_for_kill: nobody killed rank 0 within 120 s")
