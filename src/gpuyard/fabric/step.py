"""Training-step model for transformers under tensor, pipeline, context and data parallelism.

Rank order follows Megatron-LM (tensor fastest, then context, then data, then pipeline), so tensor
groups sit inside the NVLink domain and pipeline stages usually sit on different nodes.

Per micro-batch and pipeline stage the model adds: GEMM time at an efficiency that falls for small
matrices; FlashAttention time; memory-bound time (norms, residuals, activations, dropout) at the
device's memory bandwidth; tensor-parallel collectives (all-reduce, or all-gather + reduce-scatter
with sequence parallelism) and context-parallel ring exchanges. A step is
``micro-batches x per-micro-batch time + bubble + exposed pipeline, data-parallel and optimizer time``,
where ZeRO-3 / FSDP gathers hide layer by layer and communication that hides still slows compute.
Memory follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4) generalised to grouped-query attention and gated FFNs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from statistics import NormalDist
from typing import NamedTuple

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import DEFAULT_FRAGMENTATION, DEFAULT_RESERVED_BYTES, Cluster
from gpuyard.fabric.collectives import bus_factor, collective_time
from gpuyard.fabric.collectives import clear_caches as clear_collective_caches
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.stacks import STACKS, Stack, get_stack

GIB = 1024**3
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
# Bytes of one activation element in each training precision (fp8 runs keep bf16 activations).
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "fp32": 4}
# Kernels one transformer layer launches per micro-batch in eager PyTorch (counted with the profiler on
# gpuyard's TinyTransformer block: 2 norms, 4 + 2 projections with bias adds, reshapes, attention, GELU,
# 2 residual adds, 2 dropouts ~ 30 forward); the backward launches about twice as many. Each costs
# ``Compute.op_overhead_us`` that compute cannot hide when the kernels are small.
KERNELS_PER_LAYER_FWD = 30
# FP8 linear layers cast their input (bf16 read, fp8 written) in the forward and the output gradient in
# each of the two backward GEMMs: 3 bytes per element, three passes.
FP8_CAST_BYTES = 9
# float8 with rowwise scales runs its GEMMs at this share of the tensorwise recipe's efficiency. From
# torchao's float8 README (H100, torchtitan Llama 3 8B on 8 GPUs, FSDP2, torch.compile, per-op SAC, batch 1
# x 8192): tensorwise 7,689.5 tokens/s, rowwise 6,768 (+25.03% and +10.05% over bf16's 6,150). 0.75 is
# the factor with which this model reproduces that 1.136 ratio on that layout (a figure from outside the
# corpus; tests/unit/fabric/test_step_properties.py checks it). Rowwise runs a CUTLASS kernel with a scale
# per row where tensorwise calls cuBLAS (pytorch/pytorch#147971: most shapes at 90-100% of tensorwise with
# fast accumulation, a long tail down to 50%), and its small linears lose most (ao PR #2410).
FP8_ROWWISE_GEMM = 0.75
# Bytes each token moves through memory-bound kernels per layer in the forward pass, per unit of
# hidden width: two norms (read+write, 4h), two residual adds (6h), two dropouts with masks (5h each).
ELEMENTWISE_BYTES_PER_H = 30.0
# Bytes per parameter: bf16 weights, fp32 gradients, fp32 master weights + Adam m and v.
WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 2, 4, 12
# CUDA context, NCCL buffers and workspace kept aside on every device, plus allocator fragmentation: the
# assumed defaults of an unmeasured cluster (Compute.memory_reserved_bytes / memory_fragmentation hold
# what `gpuyard fabric calibrate` measured; Compute.reserved_bytes / fragmentation apply either).
RESERVED_BYTES, FRAGMENTATION = DEFAULT_RESERVED_BYTES, DEFAULT_FRAGMENTATION
LOSS_BYTES_PER_LOGIT = {False: 4, True: 2}  # kept for the backward: unfused fp32 / fused in-place bf16
# One ring-attention step (context parallelism): a FlashAttention launch on a K/V block, a P2P post and an
# event wait. Tens of microseconds on current stacks; it is what separates cp=2 from cp=8 at equal tokens.
RING_STEP_OVERHEAD_S = 20e-6


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
    # GPU is ``overlap_cost_s``); pipeline send/recv and expert all-to-all are exposed whole.
    tp_exposed_s: float = 0.0
    cp_exposed_s: float = 0.0
    dp_exposed_s: float = 0.0
    overlap_cost_s: float = 0.0

    @property
    def collectives(self) -> dict[str, dict[str, float]]:
        """Per collective family that runs: seconds per step in total, exposed and overlapped."""
        parts = {
            "tp": (self.tp_comm_s, self.tp_exposed_s),
            "cp": (self.cp_comm_s, self.cp_exposed_s),
            "ep": (self.ep_comm_s, self.ep_comm_s),
            "pp": (self.pp_comm_s, self.pp_comm_s),
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


def _sat(x: float, half: float) -> float:
    """Share of the large-GEMM efficiency a GEMM dimension of ``x`` reaches."""
    return x / (x + half)


# Attention by kernel family. ``Compute.attention_efficiency`` is the device's best fused kernel
# relative to a GEMM (FlashAttention 2 on Ampere, FlashAttention 3 / cuDNN on Hopper and later); the
# older families are priced against it with the kernel papers' own ratios:
# * FA2 on Hopper: FlashAttention-2 reaches about 35% of H100 peak against 75% for FlashAttention-3's
#   forward, and FA3's backward is 1.5-1.75x FA2's (Shah et al., "FlashAttention-3", 2024, abstract and
#   section 4): forward and backward together FA2 runs at about 0.6 of the Hopper kernels.
# * FA1: FlashAttention-2 is "around 2x faster than FlashAttention" (Dao, "FlashAttention-2", 2023,
#   abstract and section 4.1: FA1 reaches 25-40% of A100 peak, FA2 50-73%), on every device.
# * cuDNN fused attention is the Hopper kernel family where it exists (Transformer Engine picks it on
#   Hopper); before Hopper it runs FlashAttention-2-class kernels, as does FA3 (FA3 needs Hopper).
# * unfused (no FlashAttention): priced from its parts (:func:`_unfused_attention`), not by a ratio.
FA2_ON_HOPPER = 0.6
FA1_OF_FA2 = 0.5
# Bytes per score element that unfused attention moves through memory with 2-byte activations (Megatron-LM
# v2: fused scale-mask-softmax, then attention dropout): forward, softmax reads the scores and writes the
# probabilities (2 + 2), dropout reads them and writes its output and a 1-byte mask (2 + 2 + 1); backward,
# dropout reads the gradient and mask and writes (2 + 1 + 2), softmax reads probabilities and gradient and
# writes (2 + 2 + 2). Korthikanti et al. 2022 count the same 5 bytes per score kept for the backward.
UNFUSED_FWD_BYTES, UNFUSED_BWD_BYTES, UNFUSED_KEPT_BYTES = 9.0, 11.0, 5.0


def attention_efficiency(cluster: Cluster, family: str) -> float:
    """Throughput of a fused attention kernel family relative to a large GEMM on this cluster's device."""
    spec = cluster.spec
    hopper_or_later = spec is not None and (spec.nvlink_generation or 0) >= 4
    best = cluster.compute.attention_efficiency
    fa2 = best * FA2_ON_HOPPER if hopper_or_later else best
    if family in ("fa3", "cudnn"):
        return best
    if family == "fa2":
        return fa2
    if family == "fa1":
        return fa2 * FA1_OF_FA2
    raise ConfigError(f"attention family {family!r} has no kernel efficiency (unfused is priced by parts)")


def _attention_efficiency(cluster: Cluster, stack: Stack) -> float:
    """Attention throughput relative to a GEMM, for this stack's fused kernel family on this device."""
    return attention_efficiency(cluster, stack.attention)


@lru_cache(maxsize=1024)
def slowest_of(gpus: int) -> float:
    """Expected maximum of ``gpus`` standard normal draws (Blom's approximation, 0 for one GPU).

    A synchronous step ends when its slowest GPU does: with GPU speeds spread by sigma
    (``Compute.speed_spread``) the compute of a step on N GPUs takes ``1 + sigma x slowest_of(N)`` times
    that of the average GPU: about 1.4 sigma on 8 GPUs, 3.2 sigma on 1,024 and 3.9 sigma on 16,384.
    """
    if gpus <= 1:
        return 0.0
    return NormalDist().inv_cdf((gpus - 0.375) / (gpus + 0.25))


def comm_time(
    cluster: Cluster,
    op: str,
    size: float,
    gpus: int,
    per_domain: int | None = None,
    remote_share: float | None = None,
) -> float:
    """Seconds of one collective: the link measured on this machine when calibrated, else the model."""
    link = cluster.measured_links.get(op)
    if link is not None and gpus > 1 and gpus <= cluster.gpus_per_node and (per_domain or gpus) >= gpus:
        steps = {"all_reduce": 2 * (gpus - 1), "send_recv": 1, "all_to_all": 1}.get(op, gpus - 1)
        wire = size * bus_factor(op, gpus)
        return steps * link.hop_us * 1e-6 + wire / (link.bw_GBps * 1e9)
    return collective_time(cluster, op, size, gpus, per_domain, remote_share)


# Megatron-Core's dropless token dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
# MoEAlltoAllTokenDispatcher, with moe_utils.permute / sort_chunks_by_idxs / unpermute) moves each routed
# copy of a token (2h bytes in bf16) through four memory-bound passes forward: permute into expert order
# (read + write), sort the received chunks by local expert, unsort them, and unpermute with the routing
# probabilities (read each copy, write one token): about 14 h bytes per routed copy plus 2 h per token.
PERMUTE_BYTES_PER_COPY_H = 14
PERMUTE_BYTES_PER_TOKEN_H = 2


def permutation_bytes_per_token(model: ModelSpec, imbalance: float = 1.0) -> float:
    """Bytes a MoE layer's token permutation and unpermutation move per token, forward (0 for dense)."""
    if not model.is_moe:
        return 0.0
    copies = model.top_k * imbalance
    return (PERMUTE_BYTES_PER_COPY_H * copies + PERMUTE_BYTES_PER_TOKEN_H) * model.hidden


def remote_share(model: ModelSpec, ep: int, per_domain: int) -> float | None:
    """Fraction of a token's routed copies that leave its NVLink domain in the expert all-to-all.

    None (every peer's equal part, (ep - k) / ep) unless the model limits routing by node
    (``ModelSpec.route_nodes``): DeepSeek-V3 sends each token to experts on at most 4 nodes and sends it
    once over InfiniBand to each target node, where NVLink forwards it to the experts' GPUs
    (DeepSeek-AI, arXiv:2412.19437, sections 2.1.2 and 3.2.2). Off-domain traffic per token is then the
    expected number of distinct remote domains among ``top_k`` uniform picks, capped at ``route_nodes``,
    over the ``top_k`` copies the buffer holds.
    """
    if not model.is_moe or not model.route_nodes or ep <= per_domain:
        return None
    domains = math.ceil(ep / per_domain)
    remote = (domains - 1) * (1 - (1 - 1 / domains) ** model.top_k)
    return min(float(model.route_nodes), remote) / model.top_k


@dataclass(frozen=True)
class _Layer:
    """Seconds for one layer and one micro-batch on one GPU."""

    fwd: float
    bwd: float
    recompute: float
    attention_fwd: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    cp_exposed: float = 0.0  # the part of cp_comm (plus ring-step overheads) not hidden by attention
    tp_exposed: float = 0.0  # the part of tp_comm on the critical path (all of it without TP overlap)


def _unfused_attention(
    model: ModelSpec, cluster: Cluster, seq: int, tokens: float, tp: int, cp: int, peak: float, eff: float
) -> tuple[float, float]:
    """(forward, backward) seconds of attention without FlashAttention, for ``tokens`` query rows.

    The scores of every head are a batched GEMM over the whole s x s square (the causal mask is applied
    afterwards, so nothing is skipped), then scale-mask-softmax and dropout over them in memory, then a
    batched GEMM with V. The backward runs four such GEMMs (dP, dV, dS x K, dS^T x Q) and the dropout and
    softmax backward over the scores. GEMMs follow the device's shape law (their K is the head dimension
    or the sequence); score traffic runs at the memory bandwidth.
    """
    half_m, half_n, half_k = cluster.gemm_halves
    heads = model.heads / tp
    d = model.head_dim
    rows = seq / cp  # query rows of one sequence on this GPU (each attends to every key)
    seqs = tokens / rows

    def bmm(m: float, n: float, k: float) -> float:
        e = eff * _sat(m, half_m) * _sat(n, half_n) * _sat(k, half_k)
        return seqs * heads * 2 * m * n * k / (peak * e)

    scores = tokens * seq * heads  # score elements of this GPU's heads
    bw = cluster.memory_bw_GBps * 1e9
    fwd = bmm(rows, seq, d) + bmm(rows, d, seq) + scores * UNFUSED_FWD_BYTES / bw
    bwd = (
        bmm(rows, seq, d) + bmm(seq, d, rows) + bmm(rows, d, seq) + bmm(seq, d, rows)
    ) + scores * UNFUSED_BWD_BYTES / bw
    return fwd, bwd


def _layer_times(
    model: ModelSpec, cluster: Cluster, seq: int, cfg: ParallelConfig, stack: Stack | None = None
) -> _Layer:
    """One layer's times; for a model with dense and MoE layers, the average over its layers."""
    parts = [
        (
            share,
            _layer_times_cached(
                part,
                cluster,
                seq,
                cfg.tp,
                cfg.cp,
                cfg.micro_batch,
                cfg.recompute,
                cfg.sequence_parallel,
                cfg.ep,
                cfg.precision,
                stack or get_stack(cfg.stack),
                cfg.compiled,
                cfg.tp_overlap,
            ),
        )
        for share, part in model.parts()
    ]
    if len(parts) == 1:
        return parts[0][1]
    return _Layer(*(sum(share * getattr(t, f.name) for share, t in parts) for f in fields(_Layer)))


@lru_cache(maxsize=1 << 14)
def _layer_times_cached(
    model: ModelSpec,
    cluster: Cluster,
    seq: int,
    tp: int,
    cp: int,
    micro_batch: int,
    recompute: str,
    seqpar: bool,
    ep: int = 1,
    precision: str = "bf16",
    stack: Stack = STACKS["megatron-lm"],
    compiled: bool = False,
    tp_overlap: bool | None = None,
) -> _Layer:
    h = model.hidden
    tokens = micro_batch * seq / cp  # rows of every GEMM on this GPU
    peak = cluster.peak_for(precision) * 1e12
    # FP8 recipes (Transformer Engine, torchao float8) run the linear layers in fp8; attention stays bf16.
    attention_peak = cluster.peak_for("bf16" if precision == "fp8" else precision) * 1e12
    half_m, half_n, half_k = cluster.gemm_halves
    base = cluster.compute.efficiency(precision)
    rowwise = FP8_ROWWISE_GEMM if precision == "fp8" and stack.fp8_recipe == "rowwise" else 1.0

    def gemm_s(m: float, n: float, k: float) -> tuple[float, float]:
        """(forward, backward) seconds of an (m x k) @ (k x n) layer: backward is dgrad + wgrad."""

        def one(m: float, n: float, k: float) -> float:
            eff = rowwise * base * _sat(m, half_m) * _sat(n, half_n) * _sat(k, half_k)
            return 2 * m * n * k / (peak * eff)

        return one(m, n, k), one(m, k, n) + one(k, n, m)

    imbalance = model.expert_rows_factor(ep)
    # FFN passes per token: routed experts (padded or skewed on the busiest rank) and shared experts.
    routed = model.top_k * imbalance + model.shared_experts if model.is_moe else 1
    kv_width = 2 * model.kv_heads * model.head_dim
    attn_gemms = model.attention_gemms(tokens, tp)
    up = (2 if model.gated_mlp else 1) * model.ffn_hidden
    shapes = list(attn_gemms)  # QKV (MLA: through its latents), attention output
    ffn_rows = tokens
    if model.is_moe:  # each expert sees its share of the tokens routed by the ep group: smaller GEMMs
        ffn_rows = tokens * model.top_k * ep / model.experts * imbalance
        shapes.append((tokens, model.experts, h))  # the router
        for _ in range(model.shared_experts):  # shared experts: every token, split by tensor parallelism
            shapes += [(tokens, up / tp, h), (tokens, h, model.ffn_hidden / tp)]
    ffn_count = model.experts / ep if model.is_moe else 1  # expert GEMMs on this GPU
    gemm_fwd = gemm_bwd = 0.0
    for m, n, k in shapes:
        f, b = gemm_s(m, n, k)
        gemm_fwd, gemm_bwd = gemm_fwd + f, gemm_bwd + b
    for m, n, k in ((ffn_rows, up / tp, h), (ffn_rows, h, model.ffn_hidden / tp)):
        f, b = gemm_s(m, n, k)
        gemm_fwd, gemm_bwd = gemm_fwd + ffn_count * f, gemm_bwd + ffn_count * b

    def sat(x: float) -> float:
        return _sat(x, half_m)

    attention_eff = cluster.compute.efficiency("bf16" if precision == "fp8" else precision)
    if stack.attention == "unfused":
        attention, attention_bwd = _unfused_attention(
            model, cluster, seq, tokens, tp, cp, attention_peak, attention_eff
        )
    else:
        # Causal FlashAttention: half of the 4 x s x h score and value products per token.
        attention_eff *= _attention_efficiency(cluster, stack)
        attention = 2 * tokens * seq * model.attention_width / tp / (attention_peak * attention_eff)
        if (
            cp > 1
        ):  # ring attention runs on K/V blocks of seq / 2cp tokens (load-balanced halves): shorter tiles
            attention /= sat(seq / (2 * cp)) / sat(seq)
        attention_bwd = 2.5 * attention
    sp = tp if seqpar else 1
    # The byte counts below are for 2-byte activations; autocast stacks keep norms and residuals in fp32.
    width = (ACT_BYTES["fp32"] if stack.fp32_elementwise else ACT_BYTES[precision]) / 2
    act_bytes = routed * (6 if model.gated_mlp else 4) * model.ffn_hidden / tp
    factor = 1.0 if compiled else stack.elementwise_factor
    moved = factor * width * tokens * (ELEMENTWISE_BYTES_PER_H * h / sp + act_bytes)
    if precision == "fp8":  # each linear layer's input is cast to fp8: read 2 bytes, write 1
        moved += FP8_CAST_BYTES * tokens * (3 * h + routed * model.ffn_hidden) / tp
    elementwise = moved / (cluster.memory_bw_GBps * 1e9)
    fwd = gemm_fwd + attention + elementwise
    bwd = gemm_bwd + attention_bwd + 2 * elementwise
    if model.is_moe:  # tokens gathered into expert order and back: memory-bound, twice over backward
        permute = tokens / sp * permutation_bytes_per_token(model, imbalance) / (cluster.memory_bw_GBps * 1e9)
        fwd, bwd = fwd + permute, bwd + 2 * permute
    # Kernel dispatch (zero unless calibrated): a GPU runs queued kernels while the host issues the next,
    # so dispatch shows only where it is the slower; a CPU rank dispatches and computes on one thread.
    launches = KERNELS_PER_LAYER_FWD * cluster.compute.op_overhead_us * 1e-6
    if cluster.compute.async_dispatch:
        fwd, bwd = max(fwd, launches), max(bwd, 2 * launches)
    else:
        fwd, bwd = fwd + launches, bwd + 2 * launches
    op_sac = recompute == "selective" and stack.selective == "op"
    dots_sac = (
        recompute == "selective"
        and stack.selective == "dots-except-mlpwi"
        and not model.is_moe
        and not model.is_mla
    )
    if dots_sac:
        # MaxText's save_dot_except_mlpwi reruns the MLP input projections (gate and up), attention and the
        # memory-bound operators; the other projections' outputs are saved.
        recompute_s = elementwise + attention
        recompute_s += ffn_count * gemm_s(ffn_rows, up / tp, h)[0]
    elif op_sac:
        # torchtitan's per-op policy saves every compute op's output except every second matmul of a
        # block (wq, wk, wv, wo, w1, w3, w2: wk, wo and w3 are recomputed; w2 without a gate), and the
        # memory-bound operators, which it does not save.
        second = [(tokens, kv_width / 2 / tp, h), attn_gemms[-1]]
        second.append(
            (ffn_rows, model.ffn_hidden / tp, h) if model.gated_mlp else (ffn_rows, h, model.ffn_hidden / tp)
        )
        recompute_s = elementwise + sum(
            gemm_s(m, n, k)[0] * (ffn_count if i == 2 else 1) for i, (m, n, k) in enumerate(second)
        )
    else:
        recompute_s = {"none": 0.0, "selective": elementwise, "full": fwd}[recompute]
        if recompute == "selective" and stack.attention == "unfused":
            # Megatron's selective recomputation reruns the core attention (Korthikanti et al. 2022),
            # which is what stores the s x s scores when attention is unfused.
            recompute_s += attention
    tp_comm = tp_exposed = 0.0
    if tp > 1:
        size = tokens * h * ACT_BYTES[precision]  # activations of the micro-batch
        passes = 3 if recompute == "full" else 2  # forward, backward (and the recomputed forward)
        if seqpar:
            ag = comm_time(cluster, "all_gather", size, tp)
            rs = comm_time(cluster, "reduce_scatter", size, tp)
        else:
            ag, rs = comm_time(cluster, "all_reduce", size, tp), 0.0
        # Two collectives of each kind per layer and pass; a per-op recompute gathers the inputs of the
        # matmuls it reruns (attention and FFN inputs) once more.
        regathered = 2 * ag if op_sac and seqpar else 0.0
        tp_comm = 2 * passes * (ag + rs) + regathered
        tp_exposed = tp_comm
        if stack.tp_comm_overlap if tp_overlap is None else tp_overlap:
            hidden_able, fixed = tp_comm, 0.0
            if stack.tp_overlap_scope == "micro-pipeline":
                # PyTorch's async TP (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses only
                # all_gather -> matmul(s) on the gathered input and reduce_scatter(matmul output). With
                # separate q/k/v and gate/up projections the backward reduce-scatter of the input
                # gradient takes the sum of several matmuls, so it is not decomposed; it needs sequence
                # parallelism (without it nothing is fused).
                fixed = 2 * rs if seqpar else tp_comm
                hidden_able = tp_comm - fixed
            # Split into tp chunks pipelined with the adjacent GEMMs (ring exchange): the first chunk of
            # each collective shows, and whatever the layer's GEMMs cannot cover.
            gemms = gemm_fwd + gemm_bwd + (gemm_fwd if recompute == "full" else 0.0)
            tp_exposed = fixed + max(0.0, hidden_able - gemms) + hidden_able / tp
            tp_exposed = min(tp_comm, tp_exposed)
    cp_comm = cp_exposed = 0.0
    if cp > 1:
        kv_bytes = 2 * tokens * model.kv_heads * model.head_dim * 2 / min(tp, model.kv_heads)
        per_domain = max(1, min(cp, cluster.domain // tp))
        hop = comm_time(cluster, "send_recv", kv_bytes, cp, per_domain)
        # Ring attention: cp - 1 exchanges of K and V forward, twice that (K, V, dK, dV) backward; each
        # step's exchange hides behind that step's attention block (1/cp of the attention) or shows.
        passes = 2 if recompute == "full" else 1
        overhead = (passes + 1) * cp * RING_STEP_OVERHEAD_S
        cp_comm = (passes + 2) * (cp - 1) * hop + overhead
        step_fwd = attention / cp
        cp_exposed = (cp - 1) * (
            passes * max(0.0, hop - step_fwd) + max(0.0, 2 * hop - 2.5 * step_fwd)
        ) + overhead
    ep_comm = 0.0
    if model.is_moe and ep > 1:
        # Token dispatch and combine: two all-to-alls of the routed activations per pass, not overlapped.
        passes = 3 if recompute == "full" else 2
        per_domain = max(1, min(ep, cluster.domain // (tp * cp)))
        routed_bytes = tokens * model.top_k * imbalance * h * 2 / (tp if seqpar else 1)
        share = remote_share(model, ep, per_domain)
        ep_comm = 2 * passes * comm_time(cluster, "all_to_all", routed_bytes, ep, per_domain, share)
    return _Layer(fwd, bwd, recompute_s, attention, tp_comm, cp_comm, ep_comm, cp_exposed, tp_exposed)


def _stage_layers(model: ModelSpec, pp: int) -> tuple[int, int]:
    """(layers on the busiest stage, layers on the last stage, which also holds the output layer)."""
    per_stage = math.ceil(model.layers / pp)
    return per_stage, max(1, model.layers - (pp - 1) * per_stage) if pp > 1 else per_stage


def _activation_bytes_per_token(
    model: ModelSpec, tp: int, seqpar: bool, recompute: str, dropout: bool = True, op_sac: bool | str = False
) -> float:
    """Activation bytes one layer keeps per token for the backward pass (Korthikanti et al. 2022).

    ``dropout``: the stack's models run dropout, so its masks are kept (``Stack.dropout``); ``op_sac``:
    selective recomputation is torchtitan's per-op policy (True) or MaxText's ``save_dot_except_mlpwi``
    ("dots-except-mlpwi"), from ``Stack.selective``. For a model with dense
    and MoE layers, the average over its layers.
    """
    return sum(
        share * _activation_bytes_one(part, tp, seqpar, recompute, dropout, op_sac)
        for share, part in model.parts()
    )


def _op_sac_bytes(model: ModelSpec, tp: int, seqpar: bool) -> float:
    """Bytes per token one dense GQA layer keeps under torchtitan's per-op selective checkpointing.

    torchtitan (torchtitan/models/llama3/infra/parallelize.py, ``_save_list`` and
    ``_get_custom_policy``) checkpoints each block and saves, of the ops it runs, only the outputs of
    every second ``mm`` (the 1st, 3rd, 5th and 7th of wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2; no
    w2 without a gate, being the 6th), of SDPA (its output and fp32 log-sum-exp) and of the
    reduce-scatters after wo and w2 under sequence parallelism. Everything else, norms, RoPE and the
    activation included, is recomputed from those and the block's input, which the checkpoint keeps.
    """
    h, sp = model.hidden, (tp if seqpar else 1)
    kept = 2 * h / sp  # the block's input
    kept += 2 * model.heads * model.head_dim / tp  # wq
    kept += 2 * model.kv_heads * model.head_dim / tp  # wv
    kept += (2 * model.heads * model.head_dim + 4 * model.heads) / tp  # SDPA output and log-sum-exp
    kept += 2 * model.ffn_hidden / tp  # w1 (the gate, or the up projection without a gate)
    if model.gated_mlp:
        kept += 2 * h  # w2's output, before its reduce-scatter (a partial sum of the whole sequence)
    if tp > 1 and seqpar:
        kept += 2 * 2 * h / tp  # the reduce-scatters' outputs after wo and w2
    return kept


def _dots_sac_bytes(model: ModelSpec, tp: int, seqpar: bool) -> float:
    """Bytes per token one dense layer keeps under MaxText's ``save_dot_except_mlpwi`` remat policy.

    ``jax.checkpoint_policies.save_only_these_names("query_proj", "value_proj", "key_proj", "qkv_proj",
    "out_proj", "mlpwo")`` (MaxText layers/decoders.py, ``get_remat_policy``): the scanned layer's input
    (the scan carry), the query, key and value projections, the attention output projection and the MLP's
    down projection are kept; the MLP's input projections (mlpwi), norms, RoPE and attention are
    recomputed. XLA reuses the recomputed buffers across layers (liveness-based buffer assignment).
    """
    h, sp = model.hidden, (tp if seqpar else 1)
    kept = 2 * h / sp  # the layer input
    kept += 2 * (model.heads + 2 * model.kv_heads) * model.head_dim / tp  # query, key, value projections
    kept += 2 * 2 * h / sp  # out_proj and mlpwo outputs
    return kept


def _activation_bytes_one(
    model: ModelSpec,
    tp: int,
    seqpar: bool,
    recompute: str,
    dropout: bool = True,
    op_sac: bool | str = False,
) -> float:
    h = model.hidden
    sp = tp if seqpar else 1
    if recompute == "full":
        return 2 * h / sp  # only the layer input
    if recompute == "selective" and op_sac == "dots-except-mlpwi" and not model.is_moe and not model.is_mla:
        return _dots_sac_bytes(model, tp, seqpar)
    if recompute == "selective" and op_sac is True and not model.is_moe and not model.is_mla:
        return _op_sac_bytes(model, tp, seqpar)
    shared = 10 * h / sp  # norm inputs, GEMM inputs, dropout masks: replicated unless sequence-parallel
    if not dropout:  # the two hidden dropout masks (1 byte per element each) are not kept at p = 0
        shared -= 2 * h / sp
    qkv = 2 * (model.heads + 2 * model.kv_heads) * model.head_dim
    # each token passes through top_k routed experts (capacity padding counted) and the shared ones
    routed = model.top_k * (model.capacity_factor or 1.0) + model.shared_experts if model.is_moe else 1
    ffn = routed * (2 * model.ffn_hidden * (2 if model.gated_mlp else 1) + 2 * model.ffn_hidden)
    split = (qkv + 2 * h + ffn) / tp
    if recompute == "selective":  # norms and the FFN activation are recomputed, not stored
        shared -= 4 * h / sp
        split -= routed * 2 * model.ffn_hidden / tp
    return shared + split


def _stage_params(model: ModelSpec, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of the busiest stage holds."""
    per_stage, _ = _stage_layers(model, pp)
    layers = model.layers if pp == 1 else per_stage
    emb = model.embedding_params if pp == 1 else model.vocab * model.hidden
    dense_layer = model.layer_params - model.expert_params
    return (layers * dense_layer + emb) / tp, layers * model.expert_params / (tp * ep)


class _MemoryModel:
    """Memory per GPU of one (model, sequence length, stack), for any layout.

    The terms layouts share (stage sizes, parameters per stage, activation bytes per token, sharded
    weight and optimizer state) are computed once, by the same expressions, and looked up by their
    small keys: the planner checks tens of thousands of layouts of one model.
    """

    def __init__(self, model: ModelSpec, seq: int, profile: Stack) -> None:
        self.model, self.seq, self.profile = model, seq, profile
        # Unfused attention keeps 5 bytes per score of the s x s matrices (softmax output, dropout mask and
        # output: Korthikanti et al.'s 5 a s^2 b per layer) unless they are recomputed; without attention
        # dropout only the softmax output (2 bytes), which both the V GEMM and the softmax backward use.
        self.unfused = profile.attention == "unfused"
        # Dropout masks are kept only where dropout runs: the model's own rate (Llama, Mixtral, DeepSeek,
        # Qwen3: 0), else the stack's default.
        rate = model.dropout if model.dropout is not None else profile.dropout
        self.dropout = rate > 0
        self.score_bytes = 5.0 if self.dropout else 2.0
        # What recompute="selective" keeps: torchtitan's per-op policy (True), MaxText's named policy.
        self.op_sac: bool | str = (
            True
            if profile.selective == "op"
            else "dots-except-mlpwi"
            if profile.selective == "dots-except-mlpwi"
            else False
        )
        # The loss keeps fp32 log-probabilities of the micro-batch (4 bytes per logit), or with a fused
        # cross-entropy only the bf16 logits it writes the gradient into (2 bytes): gpuyard.fabric.stacks.
        self.logit_bytes = LOSS_BYTES_PER_LOGIT[profile.fused_loss]
        self._stages: dict[int, tuple[int, int]] = {}
        self._params: dict[tuple[int, int, int], tuple[float, float]] = {}
        self._states: dict[tuple[int, int, int, int, int], tuple[float, float, float, float]] = {}
        self._acts: dict[tuple[int, bool, str], float] = {}

    def stage_layers(self, pp: int) -> tuple[int, int]:
        """:func:`_stage_layers` of this model."""
        got = self._stages.get(pp)
        if got is None:
            got = self._stages[pp] = _stage_layers(self.model, pp)
        return got

    def stage_params(self, tp: int, pp: int, ep: int) -> tuple[float, float]:
        """:func:`_stage_params` of this model."""
        key = (tp, pp, ep)
        got = self._params.get(key)
        if got is None:
            got = self._params[key] = _stage_params(self.model, tp, pp, ep)
        return got

    def activation_bytes(self, tp: int, seqpar: bool, recompute: str) -> float:
        """:func:`_activation_bytes_per_token` of this model."""
        key = (tp, seqpar, recompute)
        got = self._acts.get(key)
        if got is None:
            got = self._acts[key] = _activation_bytes_per_token(
                self.model, tp, seqpar, recompute, self.dropout, self.op_sac
            )
        return got

    def states(self, tp: int, pp: int, ep: int, dp_cp: int, zero: int) -> tuple[float, float, float, float]:
        """(weights, grads, optimizer, optimizer-step gradient copy) bytes per GPU of the busiest stage.

        Gradients are kept in the stack's buffer dtype (``Stack.grad_bytes``). A 16-bit gradient is
        copied to fp32 for the optimizer's shard at the optimizer step (Megatron-Core's distributed
        optimizer, ``_copy_model_grads_to_main_grads``: ``shard_main_param.grad = shard_model_grad.float()``,
        dropped by ``zero_grad`` before the next forward): Megatron's distributed-optimizer table gives
        4 + 16/d bytes per parameter with 16-bit gradients against 6 + 12/d with fp32 ones. That copy
        never coexists with the activations, so it is returned apart (:meth:`parts` keeps the larger).
        The data-parallel time model reduces gradients in the same dtype (:func:`_dp_comm`).
        """
        key = (tp, pp, ep, dp_cp, zero)
        got = self._states.get(key)
        if got is None:
            dense, experts = self.stage_params(tp, pp, ep)
            weights = grads = optim = step_copy = 0.0
            grad_bytes = self.profile.grad_bytes
            copy_bytes = GRAD_BYTES if grad_bytes < GRAD_BYTES else 0
            # Megatron shards optimizer state over data and context parallel ranks; expert weights over
            # the ranks that hold the same experts (dp x cp / ep).
            for params, shard in ((dense, dp_cp), (experts, dp_cp // ep)):
                weights += params * WEIGHT_BYTES / (shard if zero >= 3 else 1)
                grads += params * grad_bytes / (shard if zero >= 2 else 1)
                optim += params * OPTIM_BYTES / (shard if zero >= 1 else 1)
                step_copy += params * copy_bytes / (shard if zero >= 1 else 1)
            got = self._states[key] = (weights, grads, optim, step_copy)
        return got

    def parts(
        self,
        tp: int,
        pp: int,
        dp: int,
        cp: int,
        micro_batch: int,
        virtual_stages: int,
        recompute: str,
        zero: int,
        seqpar: bool,
        ep: int,
        micro_batches: int,
    ) -> tuple[float, float, float, float]:
        """(weights, grads, optimizer, activations) bytes per GPU on the busiest pipeline stage."""
        model = self.model
        per_stage = self.stage_layers(pp)[0]
        weights, grads, optim, step_copy = self.states(tp, pp, ep, dp * cp, zero)
        tokens = micro_batch * self.seq / cp
        if virtual_stages == 1:
            in_flight: float = min(pp, micro_batches) * per_stage
        else:  # Megatron's interleaved warm-up on the first stage, counted in model chunks
            chunks = 2 * (pp - 1) + (virtual_stages - 1) * pp + 1
            in_flight = min(chunks, micro_batches * virtual_stages) * per_stage / virtual_stages
        acts = in_flight * tokens * self.activation_bytes(tp, seqpar, recompute)
        scores = self.score_bytes * model.heads / tp * self.seq if self.unfused else 0.0
        if recompute == "none":
            acts += in_flight * tokens * scores
        if recompute == "full":  # one layer is rebuilt in full during its backward
            acts += tokens * (self.activation_bytes(tp, seqpar, "none") + scores)
        logits = tokens * model.vocab * self.logit_bytes / tp
        # The optimizer step's fp32 gradient copy (16-bit gradients) lives while the activations do not.
        optim += max(0.0, step_copy - (acts + logits))
        return weights, grads, optim, acts + logits

    def of(self, cfg: ParallelConfig, m: int) -> dict[str, float]:
        """Bytes per GPU on the busiest stage of layout ``cfg`` with ``m`` micro-batches, by kind."""
        weights, grads, optim, acts = self.parts(
            cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.micro_batch, cfg.virtual_stages, cfg.recompute, cfg.zero,
            cfg.sequence_parallel, cfg.ep, m,
        )  # fmt: skip
        return {"weights": weights, "grads": grads, "optimizer": optim, "activations": acts}


@lru_cache(maxsize=64)
def _memory_model(model: ModelSpec, seq: int, profile: Stack) -> _MemoryModel:
    return _MemoryModel(model, seq, profile)


def memory_per_gpu(
    model: ModelSpec, seq: int, cfg: ParallelConfig, micro_batches: int, stack: Stack | None = None
) -> dict[str, float]:
    """Bytes per GPU on the busiest pipeline stage, by kind (weights, grads, optimizer, activations)."""
    return _memory_model(model, seq, stack or get_stack(cfg.stack)).of(cfg, micro_batches)


def _dp_comm(
    model: ModelSpec, cluster: Cluster, cfg: ParallelConfig, micro_batches: int, grad_bytes: int = GRAD_BYTES
) -> tuple[float, float]:
    """(gradient-side, parameter-side) data-parallel communication seconds per step; gradients are reduced
    in the stack's gradient dtype (``Stack.grad_bytes``: bf16 where its recipes turn off
    ``grad_reduce_in_fp32``)."""
    dense, experts = _stage_params(model, cfg.tp, cfg.pp, cfg.ep)
    weight_bytes = ACT_BYTES[cfg.precision]  # gathered in the compute precision (fp32 runs: fp32)
    grad_s = param_s = 0.0
    for params, group in ((dense, cfg.dp * cfg.cp), (experts, cfg.dp * cfg.cp // cfg.ep)):
        if group == 1 or params == 0:
            continue
        per_domain = max(1, min(group, cluster.domain // cfg.tp))

        def t(op: str, size: float, group: int = group, per_domain: int = per_domain) -> float:
            return comm_time(cluster, op, size, group, per_domain)

        if cfg.zero == 0:
            grad_s += t("all_reduce", params * grad_bytes)
        elif cfg.zero in (1, 2):
            grad_s += t("reduce_scatter", params * grad_bytes)
            param_s += t("all_gather", params * weight_bytes)
        else:  # ZeRO-3 / FSDP: gathered for forward and backward, gradients scattered, per micro-batch
            grad_s += micro_batches * t("reduce_scatter", params * grad_bytes)
            param_s += 2 * micro_batches * t("all_gather", params * weight_bytes)
    return grad_s, param_s


def _zero3_exposed(layer: _Layer, per_stage: int, m: int, grad_comm: float, param_comm: float) -> float:
    """Exposed ZeRO-3 / FSDP time per step: each layer's gather is prefetched one layer ahead.

    Per micro-batch a layer's parameters are gathered for the forward and again for the backward, and its
    gradients reduce-scattered after its backward. A gather hides behind the previous layer's forward,
    a gather plus a reduce-scatter behind a backward; what exceeds the compute shows, and so do the first
    gather of each pass (nothing to hide behind) and the last reduce-scatter of the step.
    """
    if grad_comm + param_comm == 0:
        return 0.0
    gather = param_comm / (2 * m * per_stage)
    scatter = grad_comm / (m * per_stage)
    fwd = layer.fwd + layer.tp_exposed / 2 + layer.cp_exposed / 2
    bwd = layer.bwd + layer.recompute + layer.tp_exposed / 2 + layer.cp_exposed / 2
    # The first layer of each pass has nothing to hide behind: its gather shows whole, once.
    per_mb = (per_stage - 1) * (max(0.0, gather - fwd) + max(0.0, gather + scatter - bwd)) + 2 * gather
    return m * per_mb + scatter


class _Terms(NamedTuple):
    """A step's time and the parts of :class:`Breakdown` (seconds per step)."""

    step: float
    compute: float
    tp_total: float
    cp_total: float
    pp_comm: float
    dp_total: float
    bubble: float
    exposed: float
    ep_total: float
    tp_exposed: float
    cp_exposed: float
    dp_exposed: float
    overlap: float


class _StepModel:
    """The step model of one (model, cluster, GPU count, batch, sequence length, precision, stack).

    What every layout of that setting shares (peak, bandwidth, the slowest-of-N factor, FLOPs per step)
    is computed once; per-layout terms that depend on a few knobs only (a layer's times, the output layer,
    a pipeline hop, data-parallel traffic) are computed once per distinct knob values and looked up. A
    lone :func:`estimate_step` and the planner's search go through the same code, so they agree exactly.
    """

    def __init__(
        self,
        model: ModelSpec,
        cluster: Cluster,
        gpus: int,
        global_batch: int,
        seq: int,
        precision: str,
        profile: Stack,
    ) -> None:
        self.model, self.cluster, self.gpus, self.global_batch, self.seq = (
            model,
            cluster,
            gpus,
            global_batch,
            seq,
        )
        self.precision, self.profile = precision, profile
        self.memory = _memory_model(model, seq, profile)
        self.peak = cluster.peak_for(precision) * 1e12
        self.bw = cluster.memory_bw_GBps * 1e9
        self.domain = cluster.domain
        self.device_memory = cluster.device_memory_bytes
        # Kept from tensors on every device: measured by calibration, else assumed (gpuyard.fabric.cluster).
        self.reserved = cluster.reserved_bytes
        self.fragmentation = cluster.fragmentation
        self.overlap_slowdown = cluster.compute.overlap_slowdown
        # The slowest of the job's GPUs sets the pace of every synchronous step (Compute.speed_spread).
        self.straggle = 1.0 + cluster.compute.speed_spread * slowest_of(gpus)
        self.model_flops = model.model_flops_per_token(seq) * global_batch * seq
        self._layers: dict[tuple[object, ...], _Layer] = {}
        self._heads: dict[tuple[int, int, int], float] = {}
        self._hops: dict[tuple[int, int, int, bool, bool], float] = {}
        self._dp: dict[tuple[int, ...], tuple[float, float]] = {}

    def layer(self, cfg: ParallelConfig) -> _Layer:
        """:func:`_layer_times` of this setting."""
        key = (
            cfg.tp,
            cfg.cp,
            cfg.micro_batch,
            cfg.recompute,
            cfg.sequence_parallel,
            cfg.ep,
            cfg.compiled,
            cfg.tp_overlap,
        )
        got = self._layers.get(key)
        if got is None:
            got = self._layers[key] = _layer_times(self.model, self.cluster, self.seq, cfg, self.profile)
        return got

    def head(self, micro_batch: int, cp: int, tp: int) -> float:
        """Seconds of the output projection and loss on the last stage, per micro-batch."""
        key = (micro_batch, cp, tp)
        got = self._heads.get(key)
        if got is None:
            model, cluster = self.model, self.cluster
            tokens = micro_batch * self.seq / cp
            # The output projection and loss, at the same GEMM efficiency as a layer.
            half_m, _, half_k = cluster.gemm_halves
            eff = (
                cluster.compute.efficiency(self.precision) * _sat(tokens, half_m) * _sat(model.hidden, half_k)
            )
            got = 6 * tokens * model.vocab * model.hidden / tp / (self.peak * eff)
            # Cross-entropy over the logits is memory-bound: bytes per logit by stack (fused or not).
            got += tokens * model.vocab / tp * self.profile.loss_bytes_per_logit / self.bw
            self._heads[key] = got
        return got

    def hop(self, micro_batch: int, cp: int, tp: int, seqpar: bool, same_domain: bool) -> float:
        """Seconds of one pipeline send/recv of a micro-batch's activations (or gradients)."""
        key = (micro_batch, cp, tp, seqpar, same_domain)
        got = self._hops.get(key)
        if got is None:
            cluster, profile = self.cluster, self.profile
            tokens = micro_batch * self.seq / cp
            full = tokens * self.model.hidden * ACT_BYTES[self.precision]
            split = seqpar or profile.pp_scatter_gather
            act = full / (tp if split else 1)
            got = comm_time(cluster, "send_recv", act, 2, 2 if same_domain else 1)
            if profile.pp_scatter_gather and not seqpar and tp > 1:
                # Megatron's scatter/gather: each TP rank sends its 1/tp slice, the next stage all-gathers it.
                got += comm_time(cluster, "all_gather", full, tp)
            self._hops[key] = got
        return got

    def dp_comm(self, cfg: ParallelConfig, m: int) -> tuple[float, float]:
        """:func:`_dp_comm` of this setting (only ZeRO-3 depends on the micro-batch count)."""
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.zero, m if cfg.zero == 3 else 0)
        got = self._dp.get(key)
        if got is None:
            grad_bytes = max(self.profile.grad_bytes, ACT_BYTES[cfg.precision])  # fp32 runs: fp32 gradients
            got = self._dp[key] = _dp_comm(self.model, self.cluster, cfg, m, grad_bytes)
        return got

    def needed(self, tensor_bytes: float) -> float:
        """Device bytes a layout needs: its tensors with the allocator's overhead, plus the reserve."""
        return tensor_bytes * self.fragmentation + self.reserved

    def memory_of(self, cfg: ParallelConfig, m: int) -> dict[str, float]:
        """:func:`memory_per_gpu` of a layout of this setting."""
        return self.memory.of(cfg, m)

    def remat_share(self, cfg: ParallelConfig, m: int, need: float, activations: float) -> float | None:
        """Share of the way from ``cfg``'s recomputation to full recomputation a compiler takes to fit.

        0 when the layout fits as planned; None when it does not and the stack's compiler does not
        rematerialise (``Stack.compiler_remat``), or when even full recomputation (only each layer's
        input kept) would not bring it under the device memory. XLA's rematerialisation recomputes
        saved values until the step fits; the time it costs is modelled as that share of the
        difference between this layout's step and the same layout with full recomputation.
        """
        over = need - self.device_memory
        if over <= 0:
            return 0.0
        if not self.profile.compiler_remat or cfg.recompute == "full":
            return None
        floor = self.memory.parts(
            cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.micro_batch, cfg.virtual_stages, "full", cfg.zero,
            cfg.sequence_parallel, cfg.ep, m,
        )[3]  # fmt: skip
        spare = (activations - floor) * self.fragmentation
        return over / spare if 0 < over <= spare else None

    def step_after_remat(self, cfg: ParallelConfig, m: int, share: float) -> _Terms:
        """The step's terms with ``share`` of the way to full recomputation taken (see remat_share)."""
        t = self.terms(cfg, m)
        if share <= 0:
            return t
        full = self.terms(replace(cfg, recompute="full"), m)
        return _Terms(*(a + share * (b - a) for a, b in zip(t, full, strict=True)))

    def terms(self, cfg: ParallelConfig, m: int) -> _Terms:
        """The step time and its parts for a layout already validated, with ``m`` micro-batches per step."""
        model = self.model
        layer = self.layer(cfg)
        per_stage, last = self.memory.stage_layers(cfg.pp)
        head = self.head(cfg.micro_batch, cfg.cp, cfg.tp)
        layer_compute = layer.fwd + layer.bwd + layer.recompute
        layer_comm = layer.tp_exposed + layer.ep_comm + layer.cp_exposed
        # The busiest stage sets the pace: a full stage, or the last one with fewer layers plus the head.
        full_stage = per_stage * (layer_compute + layer_comm)
        last_stage = last * (layer_compute + layer_comm) + head
        if cfg.pp == 1:
            t_mb, comm_mb = model.layers * (layer_compute + layer_comm) + head, model.layers * layer_comm
        elif full_stage >= last_stage:
            t_mb, comm_mb = full_stage, per_stage * layer_comm
        else:
            t_mb, comm_mb = last_stage, last * layer_comm
        # Pipeline: activations cross to the next stage forward and gradients come back, per model chunk.
        pp_comm = 0.0
        if cfg.pp > 1:
            same_domain = cfg.tp * cfg.cp * cfg.dp < self.domain
            p2p = self.hop(cfg.micro_batch, cfg.cp, cfg.tp, cfg.sequence_parallel, same_domain)
            pp_comm = 2 * (m * cfg.virtual_stages + cfg.pp - 1) * p2p
        grad_comm, param_comm = self.dp_comm(cfg, m)
        mb_fwd = per_stage * layer.fwd
        if cfg.zero == 3:
            exposed_dp = _zero3_exposed(layer, per_stage, m, grad_comm, param_comm)
        else:  # bucketed gradient reduction overlaps the last backward; parameter gather the first forward
            exposed_dp = max(0.0, grad_comm - (t_mb - mb_fwd)) + max(0.0, param_comm - mb_fwd)
        # Communication hidden behind compute still slows it (SMs and memory bandwidth are shared).
        hidden_cp = m * per_stage * max(0.0, layer.cp_comm - layer.cp_exposed)
        hidden_tp = m * per_stage * max(0.0, layer.tp_comm - layer.tp_exposed)
        dp_total, dp_exposed = grad_comm + param_comm, exposed_dp
        overlap = self.overlap_slowdown * (max(0.0, dp_total - exposed_dp) + hidden_cp + hidden_tp)
        exposed_dp += overlap
        dense, experts = self.memory.stage_params(cfg.tp, cfg.pp, cfg.ep)
        shard = cfg.dp * cfg.cp if cfg.zero >= 1 else 1
        params_owned = dense / shard + experts / max(1, shard // cfg.ep)
        optimizer = params_owned * self.profile.optimizer_bytes_per_param / self.bw
        bubble = (cfg.pp - 1) / cfg.virtual_stages * t_mb
        compute = m * (t_mb - comm_mb) + optimizer
        straggle = self.straggle
        compute, bubble = compute * straggle, bubble * straggle
        exposed = m * comm_mb + pp_comm + exposed_dp
        return _Terms(
            compute + bubble + exposed,
            compute,
            m * per_stage * layer.tp_comm,
            m * per_stage * layer.cp_comm,
            pp_comm,
            grad_comm + param_comm,
            bubble,
            exposed,
            m * per_stage * layer.ep_comm,
            m * per_stage * layer.tp_exposed,
            m * per_stage * min(layer.cp_comm, layer.cp_exposed),
            min(dp_total, dp_exposed),
            overlap,
        )

    def estimate(self, cfg: ParallelConfig, m: int, memory: dict[str, float] | None = None) -> StepEstimate:
        """The modelled step of a layout already validated, with ``m`` micro-batches per step."""
        mem = memory or self.memory_of(cfg, m)
        needed = self.needed(sum(mem.values()))
        share = self.remat_share(cfg, m, needed, mem["activations"])
        t = self.step_after_remat(cfg, m, share or 0.0)
        if share:  # the compiler recomputed saved activations until the step fit
            cut = needed - self.device_memory
            mem = {**mem, "activations": mem["activations"] - cut / self.fragmentation}
            needed = self.device_memory
        step, gpus = t.step, self.gpus
        model, seq_len, global_batch = self.model, self.seq, self.global_batch
        model_flops = self.model_flops
        recompute_extra = {"none": 0.0, "selective": 0.0, "full": 1 / 3}[cfg.recompute]
        recompute_extra += (1 / 3 - recompute_extra) * (share or 0.0)
        recomputed = recompute_extra * 6 * model.layers * model.active_layer_params * global_batch * seq_len
        hw_flops = model_flops + recomputed
        return StepEstimate(
            config=cfg,
            step_time_s=step,
            tokens_per_s=global_batch * seq_len / step,
            model_tflops_per_gpu=model_flops / step / gpus / 1e12,
            hardware_tflops_per_gpu=hw_flops / step / gpus / 1e12,
            mfu=model_flops / step / gpus / self.peak,
            memory_gib_per_gpu=needed / GIB,
            fits=share is not None,
            breakdown=Breakdown(
                t.compute,
                t.tp_total,
                t.cp_total,
                t.pp_comm,
                t.dp_total,
                t.bubble,
                t.exposed,
                t.ep_total,
                tp_exposed_s=t.tp_exposed,
                cp_exposed_s=t.cp_exposed,
                dp_exposed_s=t.dp_exposed,
                overlap_cost_s=t.overlap,
            ),
            memory_gib={k: v / GIB for k, v in mem.items()},
            memory_reserved_gib=self.reserved / GIB,
            remat_to_fit=share or 0.0,
        )


@lru_cache(maxsize=32)
def step_model(
    model: ModelSpec,
    cluster: Cluster,
    gpus: int,
    global_batch: int,
    seq_len: int,
    precision: str,
    profile: Stack,
) -> _StepModel:
    """The step model of one setting, with its per-knob terms memoised (shared by every layout of it)."""
    return _StepModel(model, cluster, gpus, global_batch, seq_len, precision, profile)


def clear_caches() -> None:
    """Forget every memoised term of the step model and the collective model (for cold-cache timings)."""
    step_model.cache_clear()
    _memory_model.cache_clear()
    _layer_times_cached.cache_clear()
    slowest_of.cache_clear()
    clear_collective_caches()


def estimate_step(
    model: ModelSpec,
    cluster: Cluster,
    gpus: int,
    global_batch: int,
    seq_len: int,
    cfg: ParallelConfig,
    memory: dict[str, float] | None = None,
    stack: Stack | None = None,
) -> StepEstimate:
    """Model one training step of ``model`` on ``gpus`` GPUs of ``cluster`` with layout ``cfg``.

    Args:
        model: the transformer.
        cluster: the cluster (accelerator figures and fabric).
        gpus: GPUs used (must equal tp x pp x dp x cp).
        global_batch: sequences per step.
        seq_len: tokens per sequence.
        cfg: the parallel layout.
        memory: :func:`memory_per_gpu` of this layout when the caller has it already.
        stack: a software-stack profile overriding ``cfg.stack`` (e.g. one with refitted constants).

    Raises:
        ConfigError: the layout does not apply to this model, batch or GPU count.
    """
    m = validate(model, gpus, global_batch, seq_len, cfg)
    profile = stack or get_stack(cfg.stack)
    return step_model(model, cluster, gpus, global_batch, seq_len, cfg.precision, profile).estimate(
        cfg, m, memory
    )
