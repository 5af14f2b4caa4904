"""Cluster description: nodes of accelerators, the fabric inside a node, NICs and the network between nodes.

Users write these as YAML or JSON (see ``presets/``), so the schema is pydantic: a wrong field is
reported by name. Bandwidths are **unidirectional per GPU** (what one ring step can push), in GB/s
(1e9 bytes/s); NIC speeds are the line rate in Gb/s as sold (HDR = 200, NDR = 400).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuyard.errors import CapacityError, ConfigError, NotFoundError
from gpuyard.hardware.catalog import AcceleratorSpec, get_spec

# Assumed, not measured (see Compute.memory_reserved_bytes): what a CUDA process holds outside the caching
# allocator, and the allocator's peak reserved over peak allocated.
DEFAULT_RESERVED_BYTES = 2 * 1024**3
DEFAULT_FRAGMENTATION = 1.05
# Share of a GPU's datasheet memory bandwidth that memory-bound kernels reach, where nothing on the
# cluster was measured. Measured on an H100 SXM (torch 2.11, `gpuyard fabric calibrate`, BENCHMARKS.md
# "Fabric: calibration on an H100"): a streaming add ran at 2.92-3.02 TB/s of the 3.35 datasheet
# (0.87-0.90; an H200 4.32 of 4.8 TB/s, 0.90), so no memory-bound kernel (a fused operator, the
# optimizer, the loss, MoE permutation) is priced above 0.89 of the datasheet; eager PyTorch layer norm,
# GELU, dropout and residual add, one kernel each and their bytes counted as the step model counts them,
# ran at 1.91-1.98 TB/s (0.57-0.59; the H200 2.45 of 4.8 TB/s, 0.51), so a stack that runs those
# operators as eager kernels (``Stack.eager_elementwise``, not compiled) moves them at 0.58. A
# calibration measures the rate itself (``Compute.memory_bw_GBps``) and replaces both shares.
GPU_STREAM_SHARE = 0.89
GPU_EAGER_ELEMENTWISE_SHARE = 0.58


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Device(_Frozen):
    """An accelerator that is not in the catalog (e.g. the CPU of a GPU-less machine)."""

    name: str = Field(description="Free-form device name.")
    memory_bytes: int = Field(gt=0, description="Memory usable by one device.")
    memory_bw_GBps: float = Field(gt=0, description="Memory bandwidth of one device.")
    bf16_tflops: float = Field(gt=0, description="Peak dense matrix TFLOP/s of one device.")


class IntraNode(_Frozen):
    """How accelerators inside one NVLink domain (usually one server) talk."""

    kind: Literal["nvswitch", "nvlink-bridge", "pcie", "loopback", "ici"]
    nvlink_generation: int | None = Field(default=None, description="NVLink generation, None without NVLink.")
    bw_GBps: float = Field(gt=0, description="Per-GPU unidirectional bandwidth into the intra-node fabric.")
    latency_us: float = Field(gt=0, description="Latency of one hop (one ring step), microseconds.")
    bw_efficiency: float = Field(
        default=0.78, gt=0, le=1, description="Share of bw_GBps that NCCL rings reach."
    )
    nvls: bool = Field(
        default=False, description="NVSwitch in-network reduction (NVLink SHARP, NVSwitch gen 3+)."
    )
    nvls_efficiency: float = Field(default=0.61, gt=0, le=1, description="Share of bw_GBps NVLS reaches.")
    domain_size: int | None = Field(
        default=None, gt=0, description="GPUs sharing one NVLink fabric (72 for NVL72)."
    )


class Nic(_Frozen):
    """The network adapters of one node."""

    count: int = Field(ge=0, description="NICs per node.")
    gbps: float = Field(gt=0, description="Line rate of one NIC, Gb/s.")
    kind: Literal["infiniband", "roce", "ethernet", "loopback"]
    gpudirect_rdma: bool = Field(
        default=True, description="NIC reads GPU memory directly (no bounce through host)."
    )
    latency_us: float = Field(gt=0, description="Latency of one network hop, microseconds.")
    bw_efficiency: float = Field(default=0.9, gt=0, le=1, description="Share of the line rate NCCL reaches.")


class Network(_Frozen):
    """The switch fabric between nodes."""

    rail_optimized: bool = Field(default=True, description="NIC i of every node on the same leaf (rail).")
    leaf_size: int = Field(default=32, gt=0, description="Nodes reachable without crossing the spine.")
    oversubscription: float = Field(
        default=1.0, ge=1, description="Leaf downlink : uplink ratio (1 = non-blocking)."
    )
    spine_latency_us: float = Field(
        default=1.0, ge=0, description="Extra latency of a hop through the spine."
    )
    spine_size: int | None = Field(
        default=None, gt=0, description="Nodes reachable through one spine layer (None: the whole cluster)."
    )
    core_oversubscription: float = Field(
        default=1.0, ge=1, description="Spine uplink ratio to the core tier, beyond spine_size nodes."
    )


class Compute(_Frozen):
    """How close kernels get to the datasheet peak (measured, not on datasheets)."""

    gemm_efficiency: float = Field(
        default=0.75, gt=0, le=1, description="Share of peak BF16 that large GEMMs reach in training."
    )
    attention_efficiency: float = Field(
        default=0.75, gt=0, le=1, description="FlashAttention throughput relative to a GEMM."
    )
    # A GEMM (M x K) @ (K x N) runs at efficiency x sat(M) sat(N) sat(K), sat(x) = x / (x + half): tile
    # quantisation, wave occupancy and the K-loop's pipeline fill penalise small dimensions, K most.
    # Fitted to 18 bf16 shapes from 2048^3 to 8192^3 and skinny ones (one side 256-4096) measured on an
    # H100 SXM with cuBLAS (torch 2.11, BENCHMARKS.md): halves 32, 64, 192, median error 2.9%, worst 9.6%.
    # `gpuyard fabric calibrate` measures them on the machine at hand.
    gemm_half: tuple[float, float, float] = Field(
        default=(32.0, 64.0, 192.0), description="GEMM (M, N, K) dimensions at half efficiency."
    )
    # The halves above come from one device. A small GEMM dimension caps a GEMM's arithmetic intensity
    # (about that many FLOPs per byte), so the size at which a device saturates follows its ridge point
    # (peak FLOP/s over memory bandwidth, the roofline's knee): on another catalog device the halves are
    # scaled by its ridge over this device's (A100: 312 TF / 2.0 TB/s = 153 FLOP/B against the H100's
    # 989 / 3.35 = 295, so about half). A calibration measures them on its own device (None here).
    gemm_half_device: str | None = Field(
        default="H100-SXM5-80GB",
        description="Catalog device gemm_half was measured on (None: this cluster's own device).",
    )
    dtype_efficiency: dict[str, float] = Field(
        default_factory=dict,
        description="Measured large-GEMM efficiency per precision (fp32, bf16); others use gemm_efficiency.",
    )
    memory_bw_GBps: float | None = Field(
        default=None,
        gt=0,
        description="Measured rate of memory-bound kernels per device (None: a share of the datasheet's).",
    )
    datasheet_memory_bw_GBps: float | None = Field(
        default=None,
        gt=0,
        description="Datasheet memory bandwidth of this cluster's parts where they differ from the catalog "
        "entry (e.g. a 96 GB HBM2e H100 at 2.4 TB/s); None: the catalog's.",
    )
    op_overhead_us: float = Field(
        default=0.0, ge=0, description="Host dispatch cost of one kernel (measured by calibration)."
    )
    async_dispatch: bool = Field(
        default=True,
        description="Kernels are queued ahead of the device (GPUs): dispatch hides unless it is the slower.",
    )
    # "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning:
    # Performance and Power Implications" (arXiv:2507.03114) measures an average 18.9% compute slowdown
    # (up to 40%) on A100 and H100 while NCCL kernels run beside GPT and Llama layers.
    # Identical GPUs do not run equally fast: Sinha et al., "Not All GPUs Are Created Equal" (SC'22,
    # arXiv:2208.11035) measure an average 8% performance variation (max 22%; outliers excluded, which
    # reach 1.5x slower than the median) between GPUs of one SKU in one cluster, across five clusters and
    # compute- and memory-bound applications. Read as the whisker-to-whisker span of a normal (about
    # +-2.7 sigma), the spread of one GPU's speed is sigma = 1.5%. A synchronous step waits for the slowest
    # of its N GPUs (gpuyard.fabric.step.slowest_of).
    speed_spread: float = Field(
        default=0.015, ge=0, lt=0.5, description="Standard deviation of one GPU's speed over identical GPUs."
    )
    overlap_slowdown: float = Field(
        default=0.19, ge=0, le=1, description="Share of hidden communication time that still slows compute."
    )
    # Device memory a training process cannot use for its tensors. Outside PyTorch's caching allocator a
    # CUDA process holds its context, the cuBLAS/cuDNN handles and NCCL's communicators and buffers; inside
    # it, the allocator reserves more than it hands out (blocks rounded up, split and cached), measured as
    # peak reserved / peak allocated. Unmeasured (None) the step model assumes DEFAULT_RESERVED_BYTES and
    # DEFAULT_FRAGMENTATION (2 GiB, 5%): assumptions, not measurements; `gpuyard fabric calibrate` measures
    # both on a CUDA machine (torch.cuda.mem_get_info against torch.cuda.memory_reserved after CUDA, cuBLAS
    # and NCCL have started; max_memory_reserved / max_memory_allocated over a short training loop).
    memory_reserved_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Device memory held outside the caching allocator (context, cuBLAS, NCCL); "
        "None: the assumed 2 GiB.",
    )
    memory_fragmentation: float | None = Field(
        default=None,
        ge=1,
        allow_inf_nan=False,
        description="Caching allocator's peak reserved / peak allocated; None: the assumed 1.05.",
    )

    def efficiency(self, precision: str) -> float:
        """Large-GEMM efficiency for ``precision`` (measured when calibrated)."""
        return self.dtype_efficiency.get(precision, self.gemm_efficiency)

    @property
    def reserved_bytes(self) -> int:
        """Device memory kept from tensors: the measured figure, else the assumed 2 GiB."""
        return DEFAULT_RESERVED_BYTES if self.memory_reserved_bytes is None else self.memory_reserved_bytes

    @property
    def fragmentation(self) -> float:
        """Allocator overhead factor on tensor memory: the measured figure, else the assumed 1.05."""
        return DEFAULT_FRAGMENTATION if self.memory_fragmentation is None else self.memory_fragmentation


@lru_cache(maxsize=256)
def _ridge_scaled(
    half: tuple[float, float, float], source: str | None, device: str
) -> tuple[float, float, float]:
    """``half`` measured on ``source``, scaled to ``device`` by the ratio of their ridge points."""
    if source is None or source == device:
        return half
    spec, ref = get_spec(device), get_spec(source)  # NotFoundError names an unknown gemm_half_device
    if not spec.bf16_tflops or not ref.bf16_tflops:
        return half
    ratio = (spec.bf16_tflops / spec.memory_bw_GBps) / (ref.bf16_tflops / ref.memory_bw_GBps)
    return (half[0] * ratio, half[1] * ratio, half[2] * ratio)


class Torus(_Frozen):
    """The ICI torus of a TPU slice (gpuyard.fabric.torus models collectives on it).

    Each chip links to its two neighbours along every dimension; ``link_GBps`` is what one link carries
    in one direction (the chip's bidirectional ICI figure / (2 x ports)).
    """

    dims: tuple[int, ...] = Field(min_length=1, max_length=3, description="Chips along each dimension.")
    wraparound: bool = Field(
        default=True, description="Each whole dimension closes into a ring (a torus); False: a mesh."
    )
    link_GBps: float = Field(gt=0, description="One ICI link, one direction, GB/s.")
    latency_us: float = Field(default=1.0, gt=0, description="Latency of one hop, microseconds.")
    bw_efficiency: float = Field(default=0.9, gt=0, le=1, description="Share of link_GBps collectives reach.")

    @property
    def chips(self) -> int:
        """Chips in the slice."""
        return math.prod(self.dims)


class MeasuredLink(_Frozen):
    """A collective measured on this machine: time = steps x hop + wire bytes / bandwidth."""

    hop_us: float = Field(gt=0)
    bw_GBps: float = Field(gt=0)


class Cluster(_Frozen):
    """A cluster: identical nodes, each with ``gpus_per_node`` accelerators, joined by a network."""

    name: str
    description: str = ""
    accelerator: str = Field(description="Name in gpuyard.hardware.catalog, or 'custom' with `device`.")
    device: Device | None = Field(default=None, description="Figures of a device that is not in the catalog.")
    gpus_per_node: int = Field(gt=0)
    nodes: int | None = Field(default=None, gt=0, description="Node count; None = as many as a plan needs.")
    intra: IntraNode
    nic: Nic
    network: Network = Field(default_factory=Network)
    compute: Compute = Field(default_factory=Compute)
    torus: Torus | None = Field(
        default=None,
        description="TPU slice: the ICI torus (the slice is the domain; slices talk over the NICs).",
    )
    collective_model: Literal["nccl", "alpha-beta"] = Field(
        default="nccl",
        description="nccl: NCCL's protocols (LL, Simple); alpha-beta: one latency, one bandwidth.",
    )
    measured_links: dict[str, MeasuredLink] = Field(
        default_factory=dict, description="Per-op links measured by `gpuyard fabric calibrate` (one node)."
    )
    sources: tuple[str, ...] = Field(default=(), description="Where the figures come from.")

    @model_validator(mode="after")
    def _slice_of_whole_hosts(self) -> Cluster:
        if self.torus is not None and self.torus.chips % self.gpus_per_node:
            raise ValueError(
                f"a torus of {self.torus.chips} chips is not a whole number of "
                f"{self.gpus_per_node}-chip hosts"
            )
        reserved = self.compute.memory_reserved_bytes
        if reserved is not None:
            try:
                memory = self.device_memory_bytes
            except NotFoundError:  # an unknown accelerator is reported where it is used
                return self
            if reserved >= memory:
                raise ValueError(
                    f"compute.memory_reserved_bytes {reserved} is not below the {memory} bytes of one "
                    f"{self.device_name}"
                )
        return self

    def __hash__(self) -> int:
        # The cost model memoises on the cluster; hashing every nested field each call is slow.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(self.model_dump_json())
            self.__dict__["_hash"] = cached
        return int(cached)

    @property
    def spec(self) -> AcceleratorSpec | None:
        """The catalog entry of the accelerator, None for a custom device."""
        return None if self.device is not None else get_spec(self.accelerator)

    @property
    def is_tpu(self) -> bool:
        """True for a TPU (catalog kind ``tpu``): XLA, not a CUDA caching allocator, owns its memory."""
        spec = self.spec
        return spec is not None and spec.kind == "tpu"

    @property
    def reserved_bytes(self) -> int:
        """Device memory kept from tensors: measured, else 0 on a TPU, else the assumed CUDA 2 GiB.

        XLA assigns every buffer of a compiled step ahead of time (buffer assignment, with liveness-based
        reuse: openxla.org/xla/architecture) and runs no CUDA context, cuBLAS workspaces or NCCL buffers
        on a TPU, so neither the CUDA reserve nor a caching allocator's overhead applies there.
        """
        if self.compute.memory_reserved_bytes is None and self.is_tpu:
            return 0
        return self.compute.reserved_bytes

    @property
    def fragmentation(self) -> float:
        """Allocator overhead on tensor memory: measured, else 1.0 on a TPU, else the assumed 1.05."""
        if self.compute.memory_fragmentation is None and self.is_tpu:
            return 1.0
        return self.compute.fragmentation

    @property
    def device_name(self) -> str:
        """The accelerator's catalog name, or the custom device's name."""
        return self.device.name if self.device else self.accelerator

    @property
    def domain(self) -> int:
        """GPUs that share the fast intra-node fabric (the NVLink domain, or a TPU slice's torus)."""
        if self.torus is not None:
            return self.torus.chips
        return self.intra.domain_size or self.gpus_per_node

    @property
    def device_memory_bytes(self) -> int:
        """Memory of one accelerator (bytes)."""
        return self.device.memory_bytes if self.device else get_spec(self.accelerator).memory_bytes

    @property
    def peak_tflops(self) -> float:
        """Peak dense BF16 TFLOP/s of one accelerator (the dtype large models train in)."""
        return self.device.bf16_tflops if self.device else get_spec(self.accelerator).peak_tflops("bf16")

    @property
    def memory_bw_GBps(self) -> float:
        """Memory bandwidth of one accelerator: measured, else the datasheet's."""
        if self.compute.memory_bw_GBps:
            return self.compute.memory_bw_GBps
        if self.compute.datasheet_memory_bw_GBps:
            return self.compute.datasheet_memory_bw_GBps
        return self.device.memory_bw_GBps if self.device else get_spec(self.accelerator).memory_bw_GBps

    def memory_bound_bw_GBps(self, eager_elementwise: bool = False) -> float:
        """GB/s at which memory-bound kernels move bytes on one accelerator.

        Measured (``Compute.memory_bw_GBps``): that rate. On a catalog GPU otherwise, the datasheet's
        bandwidth times the share kernels were measured to reach (``GPU_STREAM_SHARE``, or
        ``GPU_EAGER_ELEMENTWISE_SHARE`` for eager norm, activation, dropout and residual kernels). Other
        devices (a TPU, whose operators XLA fuses; a custom device) keep their figure: no measurement.
        """
        bw = self.memory_bw_GBps
        spec = self.spec
        if self.compute.memory_bw_GBps or spec is None or spec.kind != "gpu":
            return bw
        return bw * (GPU_EAGER_ELEMENTWISE_SHARE if eager_elementwise else GPU_STREAM_SHARE)

    @property
    def gemm_halves(self) -> tuple[float, float, float]:
        """The GEMM shape law's (M, N, K) half-efficiency sizes for this cluster's device.

        ``Compute.gemm_half`` scaled by this device's ridge point (bf16 peak / memory bandwidth) over that
        of the device it was measured on (``Compute.gemm_half_device``); unscaled where it was measured
        on this device or the device is not in the catalog (a custom ``Device``).
        """
        if self.device is not None:
            return self.compute.gemm_half
        return _ridge_scaled(self.compute.gemm_half, self.compute.gemm_half_device, self.accelerator)

    def peak_for(self, precision: str) -> float:
        """Peak dense TFLOP/s of one accelerator in ``precision`` (bf16, fp16, fp8, fp32, tf32)."""
        spec = self.spec
        if spec is None or precision == "bf16":
            return self.peak_tflops
        value = getattr(spec, f"{precision}_tflops", None)
        return float(value) if value else self.peak_tflops

    @property
    def nic_GBps_per_node(self) -> float:
        """Unidirectional network bandwidth of one node, GB/s, before efficiency."""
        return self.nic.count * self.nic.gbps / 8

    def check_gpus(self, gpus: int) -> None:
        """Check that ``gpus`` can be placed: whole nodes beyond one node, within the node count.

        Raises:
            ConfigError: gpus < 1, or more than one node's worth that does not fill nodes evenly.
            CapacityError: more GPUs than a fixed-size cluster has.
        """
        if gpus < 1:
            raise ConfigError(f"gpus must be at least 1, got {gpus}")
        if gpus > self.gpus_per_node and gpus % self.gpus_per_node:
            raise ConfigError(
                f"gpus={gpus} does not fill {self.gpus_per_node}-GPU nodes of cluster {self.name!r} evenly"
            )
        if self.torus is not None and gpus > self.domain and gpus % self.domain:
            raise ConfigError(
                f"gpus={gpus} is more than one {self.domain}-chip slice of cluster {self.name!r} "
                "but not a whole number of slices"
            )
        if self.nodes is not None and gpus > self.nodes * self.gpus_per_node:
            raise CapacityError(
                f"cluster {self.name!r} has {self.nodes * self.gpus_per_node} GPUs, {gpus} were asked for"
            )
