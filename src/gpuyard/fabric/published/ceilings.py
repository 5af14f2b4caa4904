"""The best MFU published for each device and precision (from runs.yaml), for the planner's sanity rule.

``mfu_ceilings.json`` is generated from the corpus by ``gpuyard.fabric.accuracy.mfu_ceilings`` (a unit
test keeps the two equal); it is shipped so that planning does not parse the corpus on every call.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CEILINGS_FILE = Path(__file__).with_name("mfu_ceilings.json")


@lru_cache(maxsize=1)
def load_ceilings() -> dict[str, dict[str, object]]:
    """``{"DEVICE/PRECISION": {"mfu": fraction, "run": corpus run id}}``."""
    data: dict[str, dict[str, object]] = json.loads(CEILINGS_FILE.read_text())
    return data


def mfu_warning(device: str, precision: str, mfu: float) -> str | None:
    """A one-line warning when ``mfu`` is above the best published run on ``device`` in ``precision``."""
    ceiling = load_ceilings().get(f"{device}/{precision}")
    if ceiling is None:
        return None
    best = float(str(ceiling["mfu"]))
    if mfu <= best:
        return None
    return (
        f"predicted MFU {mfu:.0%} is above the best published {precision} run on {device} "
        f"({best:.0%}, {ceiling['run']}): treat this plan's speed as optimistic"
    )
