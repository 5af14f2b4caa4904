"""One transformer layer's times for one micro-batch on one GPU: the step model's per-layer terms.

GEMMs at an efficiency that falls for small matrices, attention by kernel family (fused FlashAttention
families or unfused attention priced by its parts), memory-bound operators at the device's memory
bandwidth, a mixture-of-experts layer's router, experts and token permutation, recomputation, and the
layer's tensor-, context- and expert-parallel collectives with the part of each that compute hides.
:mod:`gpuyard.fabric.step` assembles these into a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.collectives import bus_factor, collective_time
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.stacks import STACKS, Stack, get_stack
from gpuyard.fabric.step_layout import ACT_BYTES, ParallelConfig

# Kernels one transformer layer launches per micro-batch in eager PyTorch (counted with the profiler on
# gpuyard's TinyTransformer block: 2 norms, 4 + 2 projections with bias adds, reshapes, attention, GELU,
# 2 residual adds, 2 dropouts ~ 30 forward); the backward launches about twice as many. Each costs
# ``Compute.op_overhead_us`` that compute cannot hide when the kernels are small.
KERNELS_PER_LAYER_FWD = 30
# FP8 linear layers cast their input (bf16 read, fp8 written) in the forward and the output gradient in
# each of the two backward GEMMs: 3 bytes per element, three passes.
FP8_CAST_BYTES = 9
# float8 GEMMs reach a lower share of their doubled peak than bf16 GEMMs reach of theirs, and rowwise scales
# lower still. Both factors come from torchao's float8 README (H100, torchtitan Llama 3 8B on 8 GPUs, FSDP2,
# torch.compile, per-op SAC, batch 1 x 8192): bf16 6,150 tokens/s, float8 tensorwise 7,689.5 (+25.03%),
# rowwise 6,768 (+10.05%). Each is the factor with which this model reproduces the README's ratio on that
# layout (tensorwise / bf16 1.250, tensorwise / rowwise 1.136), on an H100 at the bf16 GEMM efficiency
# measured here (0.72: 710-721 TFLOP/s of 989.5 with cuBLAS, BENCHMARKS.md "Fabric: calibration on an
# H100"): figures from outside the corpus, not fitted to its rows (tests/unit/fabric/test_step_properties.py
# checks both ratios). At bf16's efficiency against the fp8 peak the model gives +28.9% where torchao
# measured +25.0%. (The factor was 0.89 before memory-bound kernels were priced at their measured share
# of the memory bandwidth, gpuyard.fabric.cluster.GPU_STREAM_SHARE: slower memory-bound terms leave the
# GEMMs a smaller part of the step, so the same published ratio takes a faster fp8 GEMM.) FP8_GEMM
# applies to every fp8 recipe (Transformer Engine's GEMMs run on cuBLAS fp8 as
# torchao's tensorwise does); a calibration that measures fp8 GEMMs (``Compute.dtype_efficiency["fp8"]``)
# replaces it. Rowwise runs a CUTLASS kernel with a scale per row where tensorwise calls cuBLAS
# (pytorch/pytorch#147971: most shapes at 90-100% of tensorwise with fast accumulation, a long tail down to
# 50%), and its small linears lose most (ao PR #2410).
FP8_GEMM = 0.92
FP8_ROWWISE_GEMM = 0.75
# Bytes each token moves through memory-bound kernels per layer in the forward pass, per unit of
# hidden width: two norms (read+write, 4h), two residual adds (6h), two dropouts with masks (5h each).
ELEMENTWISE_BYTES_PER_H = 30.0
# One ring-attention step (context parallelism): a FlashAttention launch on a K/V block, a P2P post and an
# event wait. Tens of microseconds on current stacks; it is what separates cp=2 from cp=8 at equal tokens.
RING_STEP_OVERHEAD_S = 20e-6


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


# Host cost of one kernel launch where the cluster carries no measurement (``Compute.op_overhead_us``
# 0): 7.6-10.9 us per eager PyTorch kernel, issue to completion, measured on an H100 SXM with torch 2.11
# by ``gpuyard fabric calibrate`` (BENCHMARKS.md, "Fabric: calibration on an H100"); the midpoint. It
# applies to CUDA devices only: XLA runs a TPU step as one compiled program, and a CPU rank's dispatch
# is whatever its calibration measured.
GPU_DISPATCH_US = 9.25
# Transformer Engine's GroupedLinear (transformer_engine/pytorch/module/grouped_linear.py, the expert
# GEMMs of Megatron-Core's TEGroupedMLP) runs ``general_grouped_gemm`` over a Python list of per-expert
# row counts (``m_splits``): one cuBLAS GEMM per local expert for the forward product, and one each for
# the data gradient and the weight gradient. Two linears per expert (FFN up, with the gate fused into
# it, and FFN down): 2 GEMM launches per local expert forward, 4 backward.
EXPERT_GEMMS_FWD, EXPERT_GEMMS_BWD = 2, 4


def dispatch_us(cluster: Cluster) -> float:
    """Host microseconds per kernel launch: the calibration's, else GPU_DISPATCH_US on a CUDA device."""
    measured = cluster.compute.op_overhead_us
    if measured > 0 or not cluster.compute.async_dispatch or cluster.is_tpu:
        return measured
    return GPU_DISPATCH_US


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


# DeepEP's Hybrid-EP kernels (Megatron-Core's flex dispatcher, backend "hybridep") on GB200 NVL72: algorithm
# bandwidth of dispatch (bf16) and combine through the Torch API with 32 SMs, 4,096 tokens of 7,168,
# top-8, 8 local experts, uniform routing, by ranks in the NVLink domain (Hybrid-EP_Implementation.md of
# DeepEP's hybrid-ep branch, read in the shifangx/DeepEP fork, "GB200 Platform"). Bytes are counted as
# DeepEP counts them: each token once per destination GPU. Measured to 36 ranks; wider groups take the
# 36-rank figure.
HYBRIDEP_GBPS: dict[int, tuple[float, float]] = {
    8: (545.71, 568.94),
    16: (523.48, 521.55),
    24: (507.32, 483.76),
    32: (484.22, 464.54),
    36: (479.02, 447.89),
}


def hybridep_time(tokens: float, hidden: int, top_k: int, ep: int, act_bytes: float = 2.0) -> float:
    """Seconds of one Hybrid-EP dispatch and its combine inside an NVLink domain (both, one pass).

    Each token goes once to every GPU holding one of its ``top_k`` experts: ``ep (1 - (1 - 1/ep)^top_k)``
    GPUs under uniform routing (the force-balanced rows' routing), at :data:`HYBRIDEP_GBPS` of the
    nearest measured group size at or below ``ep``.
    """
    if ep <= 1:
        return 0.0
    sizes = [n for n in sorted(HYBRIDEP_GBPS) if n <= ep] or [min(HYBRIDEP_GBPS)]
    dispatch_gbps, combine_gbps = HYBRIDEP_GBPS[sizes[-1]]
    copies = ep * (1 - (1 - 1 / ep) ** top_k)
    size = tokens * copies * hidden * act_bytes
    return size / (dispatch_gbps * 1e9) + size / (combine_gbps * 1e9)


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
    bw = cluster.memory_bound_bw_GBps() * 1e9  # Megatron's fused scale-mask-softmax: a streaming kernel
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
    recipe = 1.0  # fp8 GEMMs against bf16's share of peak, and rowwise scales against tensorwise
    if precision == "fp8":
        recipe = 1.0 if "fp8" in cluster.compute.dtype_efficiency else FP8_GEMM
        if stack.fp8_recipe == "rowwise":
            recipe *= FP8_ROWWISE_GEMM

    def gemm_s(m: float, n: float, k: float) -> tuple[float, float]:
        """(forward, backward) seconds of an (m x k) @ (k x n) layer: backward is dgrad + wgrad."""

        def one(m: float, n: float, k: float) -> float:
            eff = recipe * base * _sat(m, half_m) * _sat(n, half_n) * _sat(k, half_k)
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
    expert_gemm_fwd = 0.0  # the routed experts' forward GEMMs (what a host sync leaves the device)
    for m, n, k in ((ffn_rows, up / tp, h), (ffn_rows, h, model.ffn_hidden / tp)):
        f, b = gemm_s(m, n, k)
        gemm_fwd, gemm_bwd = gemm_fwd + ffn_count * f, gemm_bwd + ffn_count * b
        expert_gemm_fwd += ffn_count * f

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
    # Eager stacks run each norm, activation, dropout and add as its own PyTorch kernel (their measured
    # rate); fused and compiled ones stream (gpuyard.fabric.cluster, GPU_EAGER_ELEMENTWISE_SHARE).
    eager = stack.eager_elementwise and not compiled
    elementwise = moved / (cluster.memory_bound_bw_GBps(eager) * 1e9)
    fwd = gemm_fwd + attention + elementwise
    bwd = gemm_bwd + attention_bwd + 2 * elementwise
    if model.is_moe:  # tokens gathered into expert order and back: memory-bound, twice over backward
        permute_bw = cluster.memory_bound_bw_GBps() * 1e9
        permute = tokens / sp * permutation_bytes_per_token(model, imbalance) / permute_bw
        fwd, bwd = fwd + permute, bwd + 2 * permute
    # Kernel dispatch: a GPU runs queued kernels while the host issues the next, so dispatch shows only
    # where it is the slower; a CPU rank dispatches and computes on one thread. A MoE layer's expert
    # GEMMs are launched one per local expert (EXPERT_GEMMS_FWD / _BWD).
    launch_s = dispatch_us(cluster) * 1e-6
    launches = KERNELS_PER_LAYER_FWD * launch_s
    expert_fwd = expert_bwd = 0.0
    if model.is_moe:
        # Each expert GEMM costs the host a launch, or the stack's grouped-GEMM issue time where that is
        # longer (Transformer Engine's multi-stream cuBLASLt loop: stacks.TE_MULTI_STREAM_GEMM_US).
        per_gemm = launch_s
        if launch_s > 0 and cluster.compute.async_dispatch:
            per_gemm = max(launch_s, stack.expert_gemm_issue_us * 1e-6)
        expert_fwd = EXPERT_GEMMS_FWD * ffn_count * per_gemm
        expert_bwd = EXPERT_GEMMS_BWD * ffn_count * per_gemm
    if cluster.compute.async_dispatch:
        if model.is_moe and stack.moe_host_sync and model.capacity_factor is None:
            # The dropless dispatcher copies each layer's per-expert token counts to the host before the
            # expert GEMMs (their row counts are a host list): the device queue drains there, so the
            # host's launch of the expert GEMMs runs while the device waits, and shows wherever it is
            # longer than those GEMMs. The backward keeps the counts from the forward: no sync there.
            fwd = max(fwd, launches) + max(0.0, expert_fwd - expert_gemm_fwd)
        else:
            fwd = max(fwd, launches + expert_fwd)
        bwd = max(bwd, 2 * launches + expert_bwd)
    else:
        fwd, bwd = fwd + launches + expert_fwd, bwd + 2 * launches + expert_bwd
    op_sac = recompute == "selective" and stack.selective == "op"
    layer_sac = recompute == "selective" and stack.selective == "every-2nd-layer"
    # Forward passes per step of a layer's collectives and GEMMs: the forward, and the recomputed one
    # where the layer reruns (half the layers under layer-wise selective checkpointing).
    reruns = 1.0 if recompute == "full" else 0.5 if layer_sac else 0.0
    dots_sac = (
        recompute == "selective"
        and stack.selective in ("dots-except-mlpwi", "dots")
        and not model.is_moe
        and not model.is_mla
    )
    if dots_sac:
        # MaxText's save_dot_except_mlpwi reruns the MLP input projections (gate and up), attention and the
        # memory-bound operators; the other projections' outputs are saved.
        recompute_s = elementwise + attention
        if stack.selective == "dots-except-mlpwi":  # "dots" (MaxText's minimal) keeps every matmul's output
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
    elif layer_sac:
        # torchtitan's layer-wise selective checkpointing (selective_ac_option "2", "checkpoint every
        # other layer": pytorch/torchtitan torchtitan/config_manager.py, and parallelize_llama.py wraps
        # every second block in ptd_checkpoint_wrapper, the others in nothing): on average over the
        # layers, half a forward is rerun.
        recompute_s = fwd / 2
    else:
        recompute_s = {"none": 0.0, "selective": elementwise, "full": fwd}[recompute]
        if recompute == "selective" and stack.attention == "unfused":
            # Megatron's selective recomputation reruns the core attention (Korthikanti et al. 2022),
            # which is what stores the s x s scores when attention is unfused.
            recompute_s += attention
    tp_comm = tp_exposed = 0.0
    if tp > 1:
        size = tokens * h * ACT_BYTES[precision]  # activations of the micro-batch
        passes = 2 + reruns  # forward, backward (and the recomputed forward)
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
            gemms = gemm_fwd + gemm_bwd + reruns * gemm_fwd
            tp_exposed = fixed + max(0.0, hidden_able - gemms) + hidden_able / tp
            tp_exposed = min(tp_comm, tp_exposed)
    cp_comm = cp_exposed = 0.0
    if cp > 1:
        kv_bytes = 2 * tokens * model.kv_heads * model.head_dim * 2 / min(tp, model.kv_heads)
        per_domain = max(1, min(cp, cluster.domain // tp))
        hop = comm_time(cluster, "send_recv", kv_bytes, cp, per_domain)
        # Ring attention: cp - 1 exchanges of K and V forward, twice that (K, V, dK, dV) backward; each
        # step's exchange hides behind that step's attention block (1/cp of the attention) or shows.
        passes = 1 + reruns
        overhead = (passes + 1) * cp * RING_STEP_OVERHEAD_S
        cp_comm = (passes + 2) * (cp - 1) * hop + overhead
        step_fwd = attention / cp
        cp_exposed = (cp - 1) * (
            passes * max(0.0, hop - step_fwd) + max(0.0, 2 * hop - 2.5 * step_fwd)
        ) + overhead
    ep_comm = 0.0
    if model.is_moe and ep > 1:
        # Token dispatch and combine: two all-to-alls of the routed activations per pass, not overlapped.
        passes = 2 + reruns
        per_domain = max(1, min(ep, cluster.domain // (tp * cp)))
        routed_bytes = tokens * model.top_k * imbalance * h * 2 / (tp if seqpar else 1)
        share = remote_share(model, ep, per_domain)
        ep_comm = 2 * passes * comm_time(cluster, "all_to_all", routed_bytes, ep, per_domain, share)
        if stack.moe_dispatcher == "hybridep" and ep <= per_domain and not cluster.is_tpu:
            # Hybrid-EP inside the NVLink domain: its measured bandwidth where the link model is faster.
            routed_tokens = tokens * imbalance / (tp if seqpar else 1)
            ep_comm = max(ep_comm, passes * hybridep_time(routed_tokens, h, model.top_k, ep))
    return _Layer(fwd, bwd, recompute_s, attention, tp_comm, cp_comm, ep_comm, cp_exposed, tp_exposed)
