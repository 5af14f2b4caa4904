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

The terms live by concept: :mod:`gpuyard.fabric.step_layout` (the layout, its validation and the estimate
it yields), :mod:`gpuyard.fabric.step_layer` (one layer's compute and collectives),
:mod:`gpuyard.fabric.step_memory` (memory per GPU); this module assembles a step from them and keeps
every name importable from here.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from statistics import NormalDist
from typing import NamedTuple

from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.collectives import clear_caches as clear_collective_caches
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.stacks import Stack, get_stack
from gpuyard.fabric.step_layer import (
    ELEMENTWISE_BYTES_PER_H,
    FA1_OF_FA2,
    FA2_ON_HOPPER,
    FP8_CAST_BYTES,
    FP8_GEMM,
    FP8_ROWWISE_GEMM,
    KERNELS_PER_LAYER_FWD,
    PERMUTE_BYTES_PER_COPY_H,
    PERMUTE_BYTES_PER_TOKEN_H,
    RING_STEP_OVERHEAD_S,
    UNFUSED_BWD_BYTES,
    UNFUSED_FWD_BYTES,
    UNFUSED_KEPT_BYTES,
    _Layer,
    _layer_times,
    _layer_times_cached,
    _sat,
    attention_efficiency,
    comm_time,
    permutation_bytes_per_token,
    remote_share,
)
from gpuyard.fabric.step_layout import (
    ACT_BYTES,
    GIB,
    PRECISIONS,
    RECOMPUTE,
    Breakdown,
    ParallelConfig,
    StepEstimate,
    validate,
)
from gpuyard.fabric.step_memory import (
    FRAGMENTATION,
    GRAD_BYTES,
    LOSS_BYTES_PER_LOGIT,
    OPTIM_BYTES,
    RESERVED_BYTES,
    WEIGHT_BYTES,
    _activation_bytes_per_token,
    _dots_sac_bytes,
    _memory_model,
    _op_sac_bytes,
    _stage_params,
    memory_per_gpu,
)

__all__ = [
    "ACT_BYTES",
    "ELEMENTWISE_BYTES_PER_H",
    "FA1_OF_FA2",
    "FA2_ON_HOPPER",
    "FP8_CAST_BYTES",
    "FP8_GEMM",
    "FP8_ROWWISE_GEMM",
    "FRAGMENTATION",
    "GIB",
    "GRAD_BYTES",
    "KERNELS_PER_LAYER_FWD",
    "LOSS_BYTES_PER_LOGIT",
    "OPTIM_BYTES",
    "PERMUTE_BYTES_PER_COPY_H",
    "PERMUTE_BYTES_PER_TOKEN_H",
    "PRECISIONS",
    "RECOMPUTE",
    "RESERVED_BYTES",
    "RING_STEP_OVERHEAD_S",
    "UNFUSED_BWD_BYTES",
    "UNFUSED_FWD_BYTES",
    "UNFUSED_KEPT_BYTES",
    "WEIGHT_BYTES",
    "Breakdown",
    "ParallelConfig",
    "StepEstimate",
    "_Layer",
    "_activation_bytes_per_token",
    "_dots_sac_bytes",
    "_layer_times",
    "_layer_times_cached",
    "_memory_model",
    "_op_sac_bytes",
    "_sat",
    "_stage_params",
    "attention_efficiency",
    "clear_caches",
    "comm_time",
    "estimate_step",
    "memory_per_gpu",
    "permutation_bytes_per_token",
    "remote_share",
    "slowest_of",
    "step_model",
    "validate",
]


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
    pp_exposed: float


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
        self.bw = cluster.memory_bound_bw_GBps() * 1e9  # loss and optimizer: streaming kernels
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
        pp_comm = pp_exposed = 0.0
        if cfg.pp > 1:
            same_domain = cfg.tp * cfg.cp * cfg.dp < self.domain
            p2p = self.hop(cfg.micro_batch, cfg.cp, cfg.tp, cfg.sequence_parallel, same_domain)
            pp_comm = pp_exposed = 2 * (m * cfg.virtual_stages + cfg.pp - 1) * p2p
            if self.profile.pp_async:
                # Posted asynchronously, a hop overlaps the stage's next micro-batch; the pp - 1 hops each
                # way that fill and drain the pipeline have nothing to overlap and stay on its path.
                pp_exposed = 2 * (cfg.pp - 1) * p2p
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
        hidden = max(0.0, dp_total - exposed_dp) + hidden_cp + hidden_tp + (pp_comm - pp_exposed)
        overlap = self.overlap_slowdown * hidden
        exposed_dp += overlap
        dense, experts = self.memory.stage_params(cfg.tp, cfg.pp, cfg.ep)
        shard = cfg.dp * cfg.cp if cfg.zero >= 1 else 1
        params_owned = dense / shard + experts / max(1, shard // cfg.ep)
        optimizer = params_owned * self.profile.optimizer_bytes_per_param / self.bw
        bubble = (cfg.pp - 1) / cfg.virtual_stages * t_mb
        compute = m * (t_mb - comm_mb) + optimizer
        straggle = self.straggle
        compute, bubble = compute * straggle, bubble * straggle
        exposed = m * comm_mb + pp_exposed + exposed_dp
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
            pp_exposed,
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
        if cfg.recompute == "selective" and self.profile.selective == "every-2nd-layer":
            recompute_extra = 1 / 6  # half the layers rerun their forward
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
                pp_exposed_s=t.pp_exposed,
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
