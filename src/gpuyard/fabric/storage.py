"""Storage in the plan: does data loading or checkpointing stall the GPUs on a storage tier?

A storage tier (local NVMe, a parallel file system, an object store) is described by what a source
states of it: read and write bandwidth per node and in aggregate, first-byte latency, and whether
GPUDirect Storage puts its reads straight into GPU memory. A figure no source states is left out
(None) and the check it would decide says "not stated" rather than assuming one.

Two checks against a plan (its tokens/s and its GPUs):

* **Loading**: the data loader reads ``tokens/s x bytes per token`` (token IDs as stored: 2 bytes when the
  vocabulary fits in uint16, else 4), spread over the nodes. It stalls the GPUs when that exceeds the
  tier's read bandwidth per node or in aggregate; its share of the tier is reported either way.
* **Checkpointing**: the state (:data:`gpuyard.fabric.planner.CHECKPOINT_BYTES_PER_PARAM` per parameter:
  bf16 weights, fp32 master weights and Adam moments) is written by every node at once
  (:func:`gpuyard.fabric.planner.checkpoint_stall_s`, capped by the tier's aggregate), plus one
  first-byte latency. A synchronous save stalls training that long; an asynchronous one (PyTorch DCP's
  ``async_save``, Megatron's ``--async-save``) stalls only for its copy to host memory, but only while
  the write finishes before the next checkpoint: a tier whose write outlasts the interval is flagged.

The synchronous stall is what ``gpuyard plan`` feeds into its goodput (ETTR) estimate when a tier is named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.storage_tier import StorageTier
from gpuyard.textfiles import parse_yaml, read_text

GB = 1e9
MAX_TIER_FILE_BYTES = 64 * 1024
MAX_CALIBRATION_FILE_BYTES = 16 * 1024 * 1024


# Tiers with published figures. Each states only what its source states.
TIERS: dict[str, StorageTier] = {
    t.name: t
    for t in (
        StorageTier(
            name="meta-tectonic",
            kind="parallel-fs",
            read_GBps_aggregate=2000.0,
            write_GBps_aggregate=2000.0,
            source="The Llama 3 Herd of Models (arXiv:2407.21783), section 3.3.1: Tectonic, 240 PB on 7,500 "
            "SSD servers, 2 TB/s sustained and 7 TB/s peak throughput; per-node figures not stated",
        ),
        StorageTier(
            name="superpod-gds",
            kind="parallel-fs",
            read_GBps_per_node=40.0,
            gpudirect=True,
            source="NVIDIA DGX SuperPOD reference architecture (DGX H100), storage fabric: a GDS-enabled "
            "application should read at over 40 GB/s per DGX; write and aggregate figures not stated",
        ),
        StorageTier(
            name="s3-c5n",
            kind="object-store",
            read_GBps_per_node=8.0,
            latency_ms=100.0,
            source="Amazon S3: 8,003 MB/s measured download on a c5n.18xlarge (100 Gb/s) by dvassallo's "
            "s3-benchmark (2019); first-byte latency 100-200 ms (AWS, Best practices design patterns: "
            "optimizing Amazon S3 performance); write figures not stated",
        ),
    )
}


def load_tier(name_or_path: str) -> StorageTier:
    """A tier by preset name, or a YAML/JSON file holding one.

    Raises:
        NotFoundError: neither a preset nor a file (the message lists the presets).
        ConfigError: the file is unreadable or a field is invalid.
    """
    if name_or_path in TIERS:
        return TIERS[name_or_path]
    path = Path(name_or_path).expanduser()
    wanted = None
    if not path.is_file() and "#" in name_or_path:  # CALIBRATION.json#TIER: one tier of a calibration file
        head, _, wanted = name_or_path.rpartition("#")
        path = Path(head).expanduser()
    if not (path.suffix in (".yaml", ".yml", ".json") and path.is_file()):
        raise NotFoundError(
            f"storage tier {name_or_path!r} is neither a preset ({', '.join(TIERS)}) nor a YAML/JSON file"
        )
    if path.stat().st_size > MAX_TIER_FILE_BYTES:
        with path.open("rb") as f:  # a calibration file (GEMM points, collectives) is larger: its head says
            calibration = b'"gpuyard-calibration/1"' in f.read(4096)
        if calibration and path.stat().st_size <= MAX_CALIBRATION_FILE_BYTES:
            return _calibrated_tier(path, wanted)
        raise ConfigError(f"{path}: a storage tier file is at most {MAX_TIER_FILE_BYTES} bytes")
    doc = parse_yaml(read_text(path, "storage tier"), path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of storage tier fields")
    if doc.get("format") == "gpuyard-calibration/1":
        return _calibrated_tier(path, wanted)
    if wanted is not None:
        raise ConfigError(f"{path} is a tier file, not a calibration file: give it without #{wanted}")
    try:
        return StorageTier.model_validate({"name": path.stem[:64] or "tier", **doc})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "tier"
        raise ConfigError(f"{path}: {where}: {first['msg']}") from None


def _calibrated_tier(path: Path, wanted: str | None) -> StorageTier:
    """Tier ``wanted`` (or the only one) that ``gpuyard fabric storage-bench`` put in a calibration file."""
    from gpuyard.fabric.calibration import load_calibration

    tiers = load_calibration(path).storage
    if not tiers:
        raise ConfigError(
            f"{path} holds no measured storage tier: run gpuyard fabric storage-bench --calibration"
        )
    if wanted is None:
        if len(tiers) > 1:
            raise ConfigError(f"{path} holds tiers {', '.join(sorted(tiers))}: give one as {path}#NAME")
        wanted = next(iter(tiers))
    if wanted not in tiers:
        raise NotFoundError(f"{path} holds no tier {wanted!r} (it holds {', '.join(sorted(tiers))})")
    entry = tiers[wanted]
    return entry.measurement.tier(wanted, entry.kind)


def bytes_per_token(model: ModelSpec) -> int:
    """Bytes of one stored token ID: uint16 where the vocabulary fits, else uint32."""
    return 2 if model.vocab <= 1 << 16 else 4


@dataclass(frozen=True)
class StorageCheck:
    """Whether loading and checkpointing fit a storage tier at a plan's rate (see the module docstring)."""

    tier: StorageTier
    nodes: int
    read_GBps_per_node: float  # the loader's need
    read_share: (
        float | None
    )  # need over what the tier gives (per node or aggregate, the tighter); None: not stated
    loader_stalls: bool | None
    checkpoint_bytes: float
    write_s: float | None  # one synchronous checkpoint; None: the tier states no write bandwidth
    interval_s: float
    async_keeps_up: bool | None

    @property
    def stall_share(self) -> float | None:
        """The synchronous checkpoint stall over the interval plus the stall (the goodput it costs)."""
        if self.write_s is None:
            return None
        return self.write_s / (self.interval_s + self.write_s)

    def to_dict(self) -> dict[str, object]:
        """JSON form for ``gpuyard plan --json``."""
        return {
            "tier": self.tier.name,
            "kind": self.tier.kind,
            "gpudirect": self.tier.gpudirect,
            "source": self.tier.source,
            "nodes": self.nodes,
            "loader_read_GBps_per_node": self.read_GBps_per_node,
            "loader_read_share": self.read_share,
            "loader_stalls": self.loader_stalls,
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_write_s": self.write_s,
            "checkpoint_interval_s": self.interval_s,
            "checkpoint_stall_share": self.stall_share,
            "async_checkpoint_keeps_up": self.async_keeps_up,
        }

    def lines(self) -> list[str]:
        """What ``gpuyard plan`` prints: loading, then checkpointing, each in one line."""
        t = self.tier
        gds = ", GPUDirect Storage" if t.gpudirect else ""
        rate = self.read_GBps_per_node
        need = f"{rate:.3g} GB/s per node" if rate >= 1 else f"{rate * 1e3:.3g} MB/s per node"
        if self.read_share is None:
            load = f"loading needs {need}; {t.name} states no read bandwidth: not checked"
        else:
            verdict = "STALLS the GPUs" if self.loader_stalls else "does not stall"
            load = f"loading needs {need}, {self.read_share:.1%} of what {t.name} reads: {verdict}"
        size = f"{self.checkpoint_bytes / 1e12:.2f} TB"
        every = f"every {self.interval_s / 60:.0f} min"
        if self.write_s is None:
            ckpt = f"checkpoint {size} {every}: {t.name} states no write bandwidth: not checked"
        else:
            share = self.stall_share or 0.0
            keeps = (
                "an asynchronous save keeps up"
                if self.async_keeps_up
                else "its write outlasts the interval: even an asynchronous save STALLS"
            )
            ckpt = (
                f"checkpoint {size} {every}: {self.write_s:.1f} s to write, a synchronous save stalls "
                f"{share:.1%} of the time; {keeps}"
            )
        return [f"storage {t.name} ({t.kind}{gds}): {load}", f"storage {t.name}: {ckpt}"]


def checkpoint_write_s(tier: StorageTier, model: ModelSpec, gpus: int, gpus_per_node: int) -> float | None:
    """Seconds one synchronous checkpoint of ``model`` takes to write to ``tier`` from ``gpus`` GPUs.

    None where the tier states no write bandwidth (neither per node nor in aggregate).
    """
    from gpuyard.fabric.planner import checkpoint_stall_s

    if tier.write_GBps_per_node is None and tier.write_GBps_aggregate is None:
        return None
    seconds = checkpoint_stall_s(
        model,
        gpus,
        gpus_per_node,
        tier.write_GBps_per_node if tier.write_GBps_per_node is not None else math.inf,
        tier.write_GBps_aggregate if tier.write_GBps_aggregate is not None else math.inf,
    )
    return seconds + tier.latency_ms / 1e3


def check_storage(
    tier: StorageTier,
    model: ModelSpec,
    tokens_per_s: float,
    gpus: int,
    gpus_per_node: int,
    interval_s: float,
    seq_len: int | None = None,
    sample_bytes: int | None = None,
) -> StorageCheck:
    """Loading and checkpoint writes of a plan against ``tier``.

    The loader reads ``sample_bytes`` per sequence of ``seq_len`` tokens where given (a dataset of
    images or raw text), else the stored token IDs (:func:`bytes_per_token`).

    Raises:
        ConfigError: a non-positive rate, GPU count or interval, or sample bytes without a sequence length.
    """
    from gpuyard.fabric.planner import CHECKPOINT_BYTES_PER_PARAM

    if not tokens_per_s > 0 or gpus < 1 or gpus_per_node < 1 or not interval_s > 0:
        raise ConfigError("storage check needs tokens/s > 0, GPUs >= 1 and a checkpoint interval > 0")
    if not math.isfinite(interval_s) or not math.isfinite(tokens_per_s):
        raise ConfigError("storage check needs a finite rate and checkpoint interval")
    if sample_bytes is not None:
        if sample_bytes < 1 or not seq_len or seq_len < 1:
            raise ConfigError("bytes per sample must be >= 1 and needs the sequence length")
        per_token = sample_bytes / seq_len
    else:
        per_token = bytes_per_token(model)
    nodes = max(1, math.ceil(gpus / gpus_per_node))
    need_total = tokens_per_s * per_token / GB
    need = need_total / nodes
    shares = []
    if tier.read_GBps_per_node is not None:
        shares.append(need / tier.read_GBps_per_node)
    if tier.read_GBps_aggregate is not None:
        shares.append(need_total / tier.read_GBps_aggregate)
    share = max(shares) if shares else None
    write_s = checkpoint_write_s(tier, model, gpus, gpus_per_node)
    return StorageCheck(
        tier=tier,
        nodes=nodes,
        read_GBps_per_node=need,
        read_share=share,
        loader_stalls=None if share is None else share > 1.0,
        checkpoint_bytes=model.params * CHECKPOINT_BYTES_PER_PARAM,
        write_s=write_s,
        interval_s=interval_s,
        async_keeps_up=None if write_s is None else write_s < interval_s,
    )
