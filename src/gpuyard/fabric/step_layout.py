"""A parallel layout of a training step, its validation against a model and batch, and the modelled step.

:class:`ParallelConfig` is what the planner searches and :func:`validate` checks; :class:`StepEstimate` and
its :class:`Breakdown` are what the step model (:mod:`gpuyard.fabric.step`) returns for one layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpuyard.errors import ConfigError
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.stacks import STACKS

GIB = 1024**3
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
# Bytes of one activation element in each training precision (fp8 runs keep bf16 activations).
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "fp32": 4}


@dataclass(frozen=True)
class ParallelConfig:
    """One parallel layout and its memory knobs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch: int = 1
    virtual_stages: int = 1
    recompute: str = "none"
    zero: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism (mixture of experts), carved out of the data-parallel ranks
    precision: str = "bf16"  # bf16 | fp16 | fp8 | fp32: GEMM peak, activation and gradient bytes
    stack: str = "megatron-lm"  # software-stack profile (gpuyard.fabric.stacks)
    compiled: bool = False  # torch.compile (or another compiler) fuses the memory-bound operators
    tp_overlap: bool | None = None  # TP comm overlapped with GEMMs (None: the stack's default)

    @property
    def gpus(self) -> int:
        """GPUs the layout uses."""
        return self.tp * self.pp * self.dp * self.cp


@dataclass(frozen=True)
class Breakdown:
    """Where a step's time goes (seconds). step = compute + bubble + exposed_comm."""

    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    exposed_comm_s: float
    ep_comm_s: float = 0.0
    # Exposed part of each family's time (the rest overlaps compute, whose slowdown from sharing the
    # GPU is ``overlap_cost_s``); expert all-to-all is exposed whole, pipeline send/recv unless asynchronous.
    tp_exposed_s: float = 0.0
    cp_exposed_s: float = 0.0
    dp_exposed_s: float = 0.0
    overlap_cost_s: float = 0.0
    # Exposed part of the pipeline's send/recv time (None: all of it; asynchronous sends overlap compute
    # but for the hops that fill and drain the pipeline, Stack.pp_async).
    pp_exposed_s: float | None = None

    @property
    def collectives(self) -> dict[str, dict[str, float]]:
        """Per collective family that runs: seconds per step in total, exposed and overlapped."""
        parts = {
            "tp": (self.tp_comm_s, self.tp_exposed_s),
            "cp": (self.cp_comm_s, self.cp_exposed_s),
            "ep": (self.ep_comm_s, self.ep_comm_s),
            "pp": (self.pp_comm_s, self.pp_comm_s if self.pp_exposed_s is None else self.pp_exposed_s),
            "dp": (self.dp_comm_s, self.dp_exposed_s),
        }
        return {
            name: {"total_s": total, "exposed_s": exposed, "overlapped_s": max(0.0, total - exposed)}
            for name, (total, exposed) in parts.items()
            if total > 0
        }


@dataclass(frozen=True)
class StepEstimate:
    """The modelled step of one layout."""

    config: ParallelConfig
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    memory_gib_per_gpu: float
    fits: bool
    breakdown: Breakdown
    memory_gib: dict[str, float] = field(default_factory=dict)  # tensors by kind (logits in activations)
    memory_reserved_gib: float = 0.0  # held outside the caching allocator (Compute.reserved_bytes)
    # Share of the way to full recomputation the compiler took to fit the device (XLA; 0: fits as planned).
    remat_to_fit: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """The issue's plan shape: the layout's knobs, then figures, then the breakdown."""
        out: dict[str, object] = dict(asdict(self.config))
        out.update(
            {
                k: getattr(self, k)
                for k in (
                    "step_time_s",
                    "tokens_per_s",
                    "model_tflops_per_gpu",
                    "hardware_tflops_per_gpu",
                    "mfu",
                    "memory_gib_per_gpu",
                    "fits",
                    "remat_to_fit",
                )
            }
        )
        out["breakdown"] = {**asdict(self.breakdown), "collectives": self.breakdown.collectives}
        # Tensors by kind, the caching allocator's overhead on them and the reserve: these sum to
        # memory_gib_per_gpu, so a plan that does not fit shows which part does not.
        overhead = max(
            0.0, self.memory_gib_per_gpu - sum(self.memory_gib.values()) - self.memory_reserved_gib
        )
        out["memory_breakdown_gib"] = {
            **self.memory_gib,
            "allocator_overhead": overhead,
            "reserved": self.memory_reserved_gib,
        }
        return out


def validate(model: ModelSpec, gpus: int, global_batch: int, seq_len: int, cfg: ParallelConfig) -> int:
    """Check a layout against the model and batch; return the number of micro-batches per step.

    Raises:
        ConfigError: the message says which constraint fails.
    """
    if cfg.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {cfg.recompute!r}")
    if cfg.stack not in STACKS:
        raise ConfigError(f"unknown software stack {cfg.stack!r}; known: {', '.join(STACKS)}")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {cfg.zero}")
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.micro_batch, cfg.virtual_stages) < 1:
        raise ConfigError(f"every parallel size must be at least 1: {cfg}")
    if seq_len < 1 or global_batch < 1:
        raise ConfigError(
            f"sequence length and global batch must be at least 1, got {seq_len} and {global_batch}"
        )
    if model.heads % cfg.tp or (model.kv_heads % cfg.tp and cfg.tp % model.kv_heads):
        raise ConfigError(
            f"tensor-parallel size {cfg.tp} does not divide the {model.heads} heads "
            f"({model.kv_heads} KV heads) of {model.name}"
        )
    if cfg.gpus != gpus:
        raise ConfigError(f"tp x pp x dp x cp = {cfg.gpus}, not the {gpus} GPUs asked for")
    if seq_len % (2 * cfg.cp) and cfg.cp > 1:
        raise ConfigError(f"context-parallel size {cfg.cp} needs seq_len {seq_len} divisible by {2 * cfg.cp}")
    if cfg.pp * cfg.virtual_stages > model.layers:
        raise ConfigError(
            f"pp x virtual_stages = {cfg.pp * cfg.virtual_stages} exceeds {model.layers} layers"
        )
    if global_batch % (cfg.dp * cfg.micro_batch):
        raise ConfigError(
            f"global batch {global_batch} is not a multiple of dp x micro_batch = "
            f"{cfg.dp} x {cfg.micro_batch}"
        )
    if cfg.ep > 1 and (not model.is_moe or model.experts % cfg.ep or cfg.dp % cfg.ep):
        raise ConfigError(
            f"expert-parallel size {cfg.ep} needs a mixture-of-experts model whose experts "
            f"({model.experts}) and data-parallel size ({cfg.dp}) it divides"
        )
    micro_batches = global_batch // (cfg.dp * cfg.micro_batch)
    if cfg.virtual_stages > 1 and (cfg.pp == 1 or micro_batches % cfg.pp):
        raise ConfigError(
            f"the interleaved schedule needs pp > 1 and micro-batches ({micro_batches}) "
            f"divisible by pp ({cfg.pp})"
        )
    return micro_batches
