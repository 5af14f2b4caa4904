"""Memory per GPU of a training layout: weights, gradients, optimizer state and activations.

Follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4) generalised to grouped-query attention, gated FFNs and mixtures of experts, with the
selective-recomputation policies of the software stacks (:mod:`gpuyard.fabric.stacks`).
"""

from __future__ import annotations

import math
from functools import lru_cache

from gpuyard.fabric.cluster import DEFAULT_FRAGMENTATION, DEFAULT_RESERVED_BYTES
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.stacks import Stack, get_stack
from gpuyard.fabric.step_layout import ParallelConfig

# Bytes per parameter: bf16 weights, fp32 gradients, fp32 master weights + Adam m and v.
WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 2, 4, 12
# CUDA context, NCCL buffers and workspace kept aside on every device, plus allocator fragmentation: the
# assumed defaults of an unmeasured cluster (Compute.memory_reserved_bytes / memory_fragmentation hold
# what `gpuyard fabric calibrate` measured; Compute.reserved_bytes / fragmentation apply either).
RESERVED_BYTES, FRAGMENTATION = DEFAULT_RESERVED_BYTES, DEFAULT_FRAGMENTATION
LOSS_BYTES_PER_LOGIT = {False: 4, True: 2}  # kept for the backward: unfused fp32 / fused in-place bf16


def _stage_layers(model: ModelSpec, pp: int) -> tuple[int, int]:
    """(layers on the busiest stage, layers on the last stage, which also holds the output layer)."""
    per_stage = math.ceil(model.layers / pp)
    return per_stage, max(1, model.layers - (pp - 1) * per_stage) if pp > 1 else per_stage


def _activation_bytes_per_token(
    model: ModelSpec, tp: int, seqpar: bool, recompute: str, dropout: bool = True, op_sac: bool | str = False
) -> float:
    """Activation bytes one layer keeps per token for the backward pass (Korthikanti et al. 2022).

    ``dropout``: the stack's models run dropout, so its masks are kept (``Stack.dropout``); ``op_sac``:
    selective recomputation is torchtitan's per-op policy (True) or layer-wise one ("every-2nd-layer"),
    or MaxText's ``save_dot_except_mlpwi`` ("dots-except-mlpwi") or ``minimal`` ("dots"), from
    ``Stack.selective``. For a model with dense
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


def _dots_sac_bytes(model: ModelSpec, tp: int, seqpar: bool, mlpwi: bool = False) -> float:
    """Bytes per token one dense layer keeps under MaxText's ``save_dot_except_mlpwi`` remat policy.

    ``jax.checkpoint_policies.save_only_these_names("query_proj", "value_proj", "key_proj", "qkv_proj",
    "out_proj", "mlpwo")`` (MaxText layers/decoders.py, ``get_remat_policy``): the scanned layer's input
    (the scan carry), the query, key and value projections, the attention output projection and the MLP's
    down projection are kept; the MLP's input projections (mlpwi), norms, RoPE and attention are
    recomputed. XLA reuses the recomputed buffers across layers (liveness-based buffer assignment).

    ``mlpwi``: MaxText's ``minimal`` policy instead, ``jax.checkpoint_policies.
    checkpoint_dots_with_no_batch_dims`` (MaxText/layers/models.py at 04262f3cf, lines 216-217): every
    weight matmul's output is kept, the MLP's input projections (wi_0 and wi_1 of a gated MLP, 2 bytes per
    element of ``ffn_hidden`` each, sharded over 'tensor' as 'activation_mlp') too; attention (a batched
    dot, or the flash kernel), norms and the MLP activation are recomputed.
    """
    h, sp = model.hidden, (tp if seqpar else 1)
    kept = 2 * h / sp  # the layer input
    kept += 2 * (model.heads + 2 * model.kv_heads) * model.head_dim / tp  # query, key, value projections
    kept += 2 * 2 * h / sp  # out_proj and mlpwo outputs
    if mlpwi:
        kept += 2 * model.ffn_hidden * (2 if model.gated_mlp else 1) / tp
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
    if recompute == "selective" and op_sac == "every-2nd-layer":
        # torchtitan's layer-wise policy: every other block keeps only its input, the others everything
        full = _activation_bytes_one(model, tp, seqpar, "full", dropout)
        return (full + _activation_bytes_one(model, tp, seqpar, "none", dropout)) / 2
    if (
        recompute == "selective"
        and op_sac in ("dots-except-mlpwi", "dots")
        and not model.is_moe
        and not model.is_mla
    ):
        return _dots_sac_bytes(model, tp, seqpar, mlpwi=op_sac == "dots")
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
        # What recompute="selective" keeps: torchtitan's per-op policy (True) or layer-wise one, MaxText's
        # named policy.
        named = profile.selective in ("dots-except-mlpwi", "dots", "every-2nd-layer")
        self.op_sac: bool | str = True if profile.selective == "op" else profile.selective if named else False
        # The loss keeps fp32 log-probabilities of the micro-batch (4 bytes per logit), or with a fused
        # cross-entropy only the bf16 logits it writes the gradient into (2 bytes): gpuyard.fabric.stacks.
        self.logit_bytes = LOSS_BYTES_PER_LOGIT[profile.fused_loss]
        # A stack that keeps width-h activations sharded over 'tensor' (Stack.activation_embed_sharded,
        # MaxText) stores them as sequence parallelism does.
        self.embed_sharded = profile.activation_embed_sharded
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
        seqpar = seqpar or self.embed_sharded
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
        elif recompute == "selective" and self.op_sac == "every-2nd-layer":
            # Half the layers keep everything (their scores too); a checkpointed one is rebuilt in full.
            acts += in_flight * tokens * scores / 2
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
