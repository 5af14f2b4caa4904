"""The best MFU published for each device, precision and sequence-length band, for the planner's sanity rule.

``mfu_ceilings.json`` is generated from the corpus by ``gpuyard.fabric.accuracy.mfu_ceilings`` (a unit
test keeps the two equal); it is shipped so that planning does not parse the corpus on every call.

Every figure is compared in one FLOP convention, causal attention (6N + 6 l h s per token): each
published row is first read with its source's own convention (kept as ``source_mfu`` with the printed
``figure``, which the warning quotes), then recounted; a plan's MFU (PaLM's count, full attention) is
recounted the same way before the comparison.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuyard.fabric.models import ModelSpec

CEILINGS_FILE = Path(__file__).with_name("mfu_ceilings.json")

# Sequence-length bands: attention's share of the FLOPs, and what limits MFU, change with the length.
BANDS = ((4096, "le4k"), (16384, "4k-16k"), (None, "gt16k"))


def seq_band(seq_len: int) -> str:
    """The band name of a sequence length."""
    for limit, name in BANDS:
        if limit is None or seq_len <= limit:
            return name
    raise AssertionError("unreachable: the last band has no limit")


@lru_cache(maxsize=1)
def load_ceilings() -> dict[str, dict[str, object]]:
    """``{"DEVICE/PRECISION/BAND": {"mfu", "source_mfu", "convention", "figure", "seq_len", "run"}}``."""
    data: dict[str, dict[str, object]] = json.loads(CEILINGS_FILE.read_text())
    return data


def _ceiling(device: str, precision: str, seq_len: int) -> tuple[dict[str, object], str] | None:
    """The ceiling of the band of ``seq_len``, else of the nearest band with a published row."""
    names = [name for _, name in BANDS]
    here = names.index(seq_band(seq_len))
    ceilings = load_ceilings()
    for name in sorted(names, key=lambda n: (abs(names.index(n) - here), names.index(n))):
        found = ceilings.get(f"{device}/{precision}/{name}")
        if found is not None:
            return found, name
    return None


def causal_mfu(mfu: float, model: ModelSpec, seq_len: int) -> float:
    """A PaLM-convention MFU (full attention) recounted with causal attention."""
    return mfu * model.model_flops_per_token(seq_len, causal=True) / model.model_flops_per_token(seq_len)


def mfu_warning(device: str, precision: str, mfu: float, model: ModelSpec, seq_len: int) -> str | None:
    """A one-line warning when ``mfu`` (PaLM's convention, as the step model gives it) is above the best
    published run on ``device`` in ``precision`` at that sequence length, both counted with causal
    attention; the warning quotes the source's own figure."""
    found = _ceiling(device, precision, seq_len)
    if found is None:
        return None
    ceiling, band = found
    best = float(str(ceiling["mfu"]))
    mine = causal_mfu(mfu, model, seq_len)
    if mine <= best:
        return None
    nearest = "" if band == seq_band(seq_len) else f"; nearest band with a published run: {band}"
    return (
        f"predicted MFU {mine:.0%} (causal attention count; {mfu:.0%} counting full attention) is above "
        f"the best published {precision} run on {device} at {seq_band(seq_len)} tokens{nearest}: "
        f"{ceiling['run']} at {best:.0%} ({ceiling['figure']} as published, "
        f"{float(str(ceiling['source_mfu'])):.0%} MFU by its own convention, {ceiling['convention']}): "
        f"treat this plan's speed as optimistic"
    )
