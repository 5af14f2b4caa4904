"""A storage tier as a source (or ``gpuyard fabric storage-bench``) describes it.

Apart from :mod:`gpuyard.fabric.storage` (the checks against a plan) so that the benchmark's result and
the calibration file can name the type without importing the checks, which read calibration files.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StorageTier(BaseModel):
    """One storage tier as its source describes it (GB/s are 1e9 bytes per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    kind: Literal["local-nvme", "parallel-fs", "object-store"]
    read_GBps_per_node: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    write_GBps_per_node: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    read_GBps_aggregate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    write_GBps_aggregate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    latency_ms: float = Field(default=0.0, ge=0, le=60_000, allow_inf_nan=False)
    gpudirect: bool = False  # GPUDirect Storage: reads DMA into GPU memory without a host bounce
    source: str = Field(min_length=1, max_length=2000)
