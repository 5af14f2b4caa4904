"""The calibration file: what ``gpuyard fabric calibrate`` measured, how it is stored, and how it applies.

:class:`Calibration` is the file's schema (``gpuyard-calibration/1``); :func:`load_calibration`,
:func:`save_calibration` and :func:`add_storage` read and write it; :func:`apply_calibration` replaces a
cluster's compute, memory and measured links with its figures, and refuses a file measured on another
device. The measurement itself is :mod:`gpuyard.fabric.calibrate`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster, Compute, Device, IntraNode, MeasuredLink
from gpuyard.fabric.storage_bench import CalibratedTier, Kind, StorageMeasurement

FORMAT = "gpuyard-calibration/1"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GemmPoint(_Doc):
    """One measured GEMM: (M x K) @ (K x N) in ``dtype``."""

    dtype: str
    m: int
    n: int
    k: int
    tflops: float


class GemmFit(_Doc):
    """``tflops = peak_tflops x sat(M, half_m) sat(N, half_n) sat(K, half_k)``, sat(x, h) = x / (x + h)."""

    peak_tflops: float = Field(gt=0)
    half_m: float = Field(ge=0)
    half_n: float = Field(ge=0)
    half_k: float = Field(ge=0)
    median_error: float = Field(ge=0, description="Median relative error of the fit over the points.")
    max_error: float = Field(ge=0, description="Largest relative error of the fit over the points.")


class Calibration(_Doc):
    """What ``gpuyard fabric calibrate`` measured on one host, and the figures derived from it."""

    format: Literal["gpuyard-calibration/1"] = "gpuyard-calibration/1"
    created: str
    host: str
    device_kind: Literal["cpu", "cuda"]
    device_name: str
    accelerator: str = Field(description="Catalog name of the GPU, or 'custom' for a CPU.")
    ranks: int = Field(gt=0, description="Processes measured at once on this host.")
    threads_per_rank: int = Field(gt=0)
    backend: str | None = Field(default=None, description="torch.distributed backend of the collectives.")
    gemm: list[GemmPoint]
    gemm_fit: dict[str, GemmFit]
    attention_tflops: float = Field(gt=0)
    attention_efficiency: float = Field(gt=0)
    memory_bw_GBps: float = Field(gt=0, description="Streaming add, per rank.")
    elementwise_GBps: float = Field(gt=0, description="Norm, GELU, dropout, add: effective GB/s per rank.")
    op_overhead_us: float = Field(ge=0)
    h2d_GBps: float | None = None
    d2h_GBps: float | None = None
    overlap_slowdown: float | None = None
    collectives: list[dict[str, Any]] = Field(default_factory=list)
    links: dict[str, MeasuredLink] = Field(default_factory=dict)
    memory_reserved_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Device memory held outside the caching allocator once CUDA, cuBLAS and NCCL run "
        "(CUDA only).",
    )
    memory_fragmentation: float | None = Field(
        default=None,
        ge=1,
        allow_inf_nan=False,
        description="Caching allocator's peak reserved / peak allocated over a short training loop "
        "(CUDA only).",
    )
    storage: dict[str, CalibratedTier] = Field(
        default_factory=dict,
        description="Storage tiers measured from this host by `gpuyard fabric storage-bench`, by name.",
    )


def check_writable(path: Path) -> None:
    """Refuse an output path whose folder does not exist or cannot be written, before measuring.

    Raises:
        ConfigError: the message names the path.
    """
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"--out {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--out {path}: folder {folder} is not writable")
    if Path(path).is_dir():
        raise ConfigError(
            f"--out {path} is a folder; give a file name (e.g. {Path(path) / 'calibration.json'})"
        )


def save_calibration(cal: Calibration, path: Path) -> None:
    """Write the calibration as JSON."""
    path.write_text(cal.model_dump_json(indent=2))


def add_storage(path: Path, name: str, kind: Kind, measurement: StorageMeasurement) -> Calibration:
    """Put a measured storage tier into the calibration file at ``path`` (replacing one of that name).

    The file is rewritten whole through a temporary file in its folder, so a crash leaves the old one.

    Raises:
        ConfigError: no calibration file there, or one that does not read (the message names it).
    """
    if not Path(path).is_file():
        raise ConfigError(
            f"no calibration file at {path}: run gpuyard fabric calibrate first, "
            "or write a tier file with --out"
        )
    cal = load_calibration(path)
    entry = CalibratedTier(kind=kind, measurement=measurement)
    updated = cal.model_copy(update={"storage": {**cal.storage, name: entry}})
    folder = Path(path).resolve().parent
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(updated.model_dump_json(indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"cannot write calibration file {path}: {exc.strerror or exc}") from None
    return updated


def load_calibration(path: Path) -> Calibration:
    """Read a calibration file.

    Raises:
        ConfigError: unreadable, not JSON, or a field is wrong (the message names it).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read calibration file {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a gpuyard calibration file (no format: {FORMAT!r})")
    try:
        return Calibration.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(
            f"{path}: field {'.'.join(str(p) for p in first['loc'])!r}: {first['msg']}"
        ) from None


def _matches(cal: Calibration, cluster: Cluster) -> str | None:
    """Why ``cal`` does not describe ``cluster``'s devices, or None when it does."""
    if cal.device_kind == "cpu":
        if cluster.device is not None and cluster.device.name.startswith("cpu"):
            return None
        return (
            f"it was measured on CPU ranks ({cal.device_name}), "
            f"cluster {cluster.name!r} has {cluster.device_name}"
        )
    if cluster.device is not None or cluster.accelerator != cal.accelerator:
        return f"it was measured on {cal.accelerator}, cluster {cluster.name!r} has {cluster.device_name}"
    return None


def apply_calibration(cluster: Cluster, cal: Calibration, where: str = "calibration") -> Cluster:
    """``cluster`` with its compute, memory and measured links replaced by the calibration's figures.

    A CPU calibration turns each measured rank into one device of the node (its share of cores, memory
    bandwidth and memory), since that is what a rank of ``gpuyard train --nproc N`` gets.

    Raises:
        ConfigError: the calibration was measured on another kind of device (one line).
    """
    why = _matches(cal, cluster)
    if why:
        raise ConfigError(f"{where} does not match the cluster: {why}")
    data = cluster.model_dump()
    dtype = "float32" if cal.device_kind == "cpu" else "bfloat16"
    if dtype not in cal.gemm_fit:
        raise ConfigError(f"{where} has no {dtype} GEMM fit, the dtype its device trains in: calibrate again")
    if cal.device_kind == "cpu":
        assert cluster.device is not None  # _matches checked it
        per_rank_peak = cluster.device.bf16_tflops / max(1, (os.cpu_count() or 1)) * cal.threads_per_rank
        peak = max(per_rank_peak, cal.gemm_fit[dtype].peak_tflops)  # a nominal figure can undershoot turbo
        data["device"] = Device(
            name=f"cpu rank ({cal.threads_per_rank} thread(s) of {cal.device_name})",
            memory_bytes=max(1, cluster.device.memory_bytes // cal.ranks),
            memory_bw_GBps=cal.memory_bw_GBps,
            bf16_tflops=peak,
        ).model_dump()
        data["gpus_per_node"] = cal.ranks
        data["nodes"] = 1
    else:
        peak = cluster.peak_tflops
    efficiency = {d: min(1.0, f.peak_tflops / _dtype_peak(cluster, d, peak)) for d, f in cal.gemm_fit.items()}
    reserved = cal.memory_reserved_bytes
    if reserved is not None and reserved >= cluster.device_memory_bytes:
        raise ConfigError(
            f"{where}: memory_reserved_bytes {reserved} is not below the {cluster.device_memory_bytes} "
            f"bytes of one {cluster.device_name}: calibrate again on an idle GPU"
        )
    data["compute"] = Compute(
        gemm_efficiency=efficiency.get(dtype, cluster.compute.gemm_efficiency),
        attention_efficiency=min(1.0, cal.attention_efficiency),
        gemm_half=(cal.gemm_fit[dtype].half_m, cal.gemm_fit[dtype].half_n, cal.gemm_fit[dtype].half_k),
        gemm_half_device=None,  # measured here, on this cluster's device
        dtype_efficiency={_short(d): e for d, e in efficiency.items()},
        # The step model moves activations through memory-bound operators at this rate.
        memory_bw_GBps=min(cal.memory_bw_GBps, cal.elementwise_GBps),
        op_overhead_us=cal.op_overhead_us,
        async_dispatch=cal.device_kind != "cpu",
        overlap_slowdown=(
            cal.overlap_slowdown if cal.overlap_slowdown is not None else cluster.compute.overlap_slowdown
        ),
        memory_reserved_bytes=reserved if reserved is not None else cluster.compute.memory_reserved_bytes,
        memory_fragmentation=(
            cal.memory_fragmentation
            if cal.memory_fragmentation is not None
            else cluster.compute.memory_fragmentation
        ),
    ).model_dump()
    if cal.links:
        data["measured_links"] = {op: link.model_dump() for op, link in cal.links.items()}
        if cal.device_kind == "cpu":
            ar = cal.links.get("all_reduce") or next(iter(cal.links.values()))
            data["intra"] = IntraNode(
                kind=cluster.intra.kind,
                bw_GBps=ar.bw_GBps,
                latency_us=max(ar.hop_us, 1e-3),
                bw_efficiency=1.0,
            ).model_dump()
            data["collective_model"] = "alpha-beta"
    data["name"] = f"{cluster.name}+calibrated"
    data["sources"] = (*cluster.sources, f"calibrated on {cal.host} at {cal.created} ({where})")
    return Cluster.model_validate(data)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _dtype_peak(cluster: Cluster, dtype: str, default: float) -> float:
    spec = cluster.spec
    if spec is None:
        return default
    value = spec.peak_tflops(_short(dtype))
    return float(value) if value else default


def load_calibrated(cluster: Cluster, path: Path | None) -> Cluster:
    """``cluster`` as it is, or with the calibration file at ``path`` applied.

    Raises:
        ConfigError: unreadable file, or a file measured on another device.
    """
    if path is None:
        return cluster
    return apply_calibration(cluster, load_calibration(path), where=f"calibration {path}")
