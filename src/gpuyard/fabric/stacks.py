"""Software-stack profiles: what differs between training stacks on the same hardware and layout.

The step model's structure (GEMMs on a roofline, attention, memory-bound operators, collectives,
overlap) is the same for every stack; a profile says how a stack runs the parts that are not the same:

* ``optimizer_bytes_per_param``: memory traffic of one Adam step per owned parameter. A fused Adam
  (Megatron's distributed optimizer, apex/TE FusedAdam, ``torch.optim.AdamW(fused=True)``) reads the
  fp32 master weight, gradient, m and v and writes weight, m and v: 28 bytes, 30 with the bf16 copy.
  PyTorch's default ``foreach`` AdamW runs one pass per operation (lerp m; mul and addcmul v; weight
  decay; sqrt, divide and add eps into a temporary; addcdiv into the weight): about 80 bytes.
* ``elementwise_factor``: bytes moved by the memory-bound operators against the step model's count
  (``ELEMENTWISE_BYTES_PER_H``: unfused norms, residuals and dropouts). Megatron/NeMo with Transformer
  Engine fuse norm+GEMM, bias+GELU and bias+dropout+add: about 0.6 of the unfused traffic.
* ``eager_elementwise``: the stack runs norms, activations, dropouts and residual adds as one eager
  PyTorch kernel each (torchtitan unless compiled, llm-foundry's MPT with its low-precision layer norm,
  DeepSpeed on Hugging Face models, gpuyard's trainer unless compiled), which reach a lower share of the
  memory bandwidth than a streaming kernel (measured: ``gpuyard.fabric.cluster``,
  ``GPU_EAGER_ELEMENTWISE_SHARE``); Megatron's and Transformer Engine's fused kernels, XLA and
  torch.compile stream them.
* ``fp32_elementwise``: autocast runs layer norms and the residual stream in fp32, so a bf16 run moves
  their bytes at 4 bytes per element (plain PyTorch autocast, as gpuyard's trainer uses).
* ``loss_bytes_per_logit``: the output layer's cross-entropy, per logit. ``F.cross_entropy`` on bf16
  logits upcasts them (write 4 bytes), takes the log-softmax (read and write 4 + 4), and the backward
  reads and writes the fp32 gradient and casts it down (4 + 4 + 2 + 2): about 24 bytes. Megatron's
  fused vocab-parallel cross-entropy reads the logits once forward and writes the gradient once: 12.
* ``attention``: the attention kernel family (``ATTENTION_FAMILIES``), priced by
  ``gpuyard.fabric.step``: "unfused" (the s x s scores materialised: two batched GEMMs over the full,
  unmasked square, a fused scale-mask-softmax and dropout over the scores in memory; Megatron-LM v2 and
  Megatron-DeepSpeed in 2021-22), "fa1" (FlashAttention 1 and its Triton port), "fa2" (FlashAttention 2:
  torchtitan's SDPA flash backend in 2024-25), "fa3" or "cudnn" (Hopper-native kernels: FlashAttention 3,
  Transformer Engine's cuDNN fused attention in Megatron-Core and NeMo). Each family's speed per device is
  in ``gpuyard.fabric.step_layer.attention_efficiency`` with its source.
* ``fused_loss``: memory of the loss. ``F.cross_entropy`` (and Megatron's default vocab-parallel
  cross-entropy) keeps fp32 log-probabilities (or softmax) of the whole micro-batch for the backward:
  4 bytes per logit. A fused cross-entropy that writes the gradient into the bf16 logits in place
  (flash-attn's ``CrossEntropyLoss(inplace_backward=True)``, llm-foundry's MPT default
  ``loss_fn: fused_crossentropy``) keeps only those: 2 bytes per logit.
* ``dropout``: the hidden and attention dropout probability of the models the stack trains, by its
  framework's default; it is memory only (a mask of one byte per element is kept for the backward only
  where the probability is above 0: PyTorch's ``dropout`` returns its input unchanged at p = 0, and
  ``native_dropout`` runs only for 0 < p < 1, aten/src/ATen/native/Dropout.cpp). Korthikanti et al.'s
  34 s b h + 5 a s^2 b / h counts two hidden masks (s b h each) and, with unfused attention, the
  attention mask and dropout output (3 of the 5 bytes per score). Megatron-LM: ``--hidden-dropout``
  and ``--attention-dropout`` default to 0.1 (megatron/training/arguments.py), as does Megatron-Core's
  ``TransformerConfig`` that NeMo and Megatron-Bridge build on (their Llama configs and NeMo's
  ``GPTConfig175B`` set 0, but its ``GPTConfig20B`` keeps 0.1: per model, which the stack cannot say, so
  the 0.1 stays); torchtitan's Llama has no dropout module; llm-foundry's MPT config defaults
  ``attn_pdrop`` and ``resid_pdrop`` to 0 (llmfoundry/models/mpt/configuration_mpt.py); MaxText's
  ``dropout_rate`` is 0 in configs/base.yml; gpuyard's own example transformer defaults to 0
  (gpuyard.train.examples). Stacks without a documented default (DeepSpeed, ``other``) keep 0.1.
* ``grad_bytes``: bytes per parameter of the gradient buffer and of its data-parallel reduction.
  Megatron-LM accumulates and reduces gradients in fp32 whenever it trains in bf16
  (``accumulate_allreduce_grads_in_fp32`` is forced on, megatron/training/arguments.py): 4.
  NeMo's and Megatron-Bridge's pre-training performance recipes
  turn that off (NeMo 2's ``pretrain_performance_optimizations``: ``trainer.plugins.grad_reduce_in_fp32 =
  False``; Megatron-Bridge's scripts/performance common overrides: ``mixed_precision.grad_reduce_in_fp32``
  and ``ddp.grad_reduce_in_fp32 = False``): bf16 gradients, 2, whose optimizer shard then keeps an fp32
  copy (Megatron's distributed-optimizer table: 4 + 16/d bytes per parameter instead of 6 + 12/d).
* ``pp_scatter_gather``: a pipeline stage sends its activations split over the tensor-parallel ranks
  (each sends 1/tp over its own NIC) and the next stage all-gathers them over NVLink: Megatron-LM's
  "scatter/gather communication optimization" (Narayanan et al., SC'21, section 4.1), on by default in
  Megatron-LM v2 (``--no-scatter-gather-tensors-in-pipeline`` turns it off). With sequence parallelism
  the activations are split already, so the flag matters only without it.
* ``tp_comm_overlap``: tensor-parallel all-gathers and reduce-scatters (or all-reduces) run split into
  chunks pipelined with the GEMMs next to them (Transformer Engine userbuffers), so only what exceeds
  the GEMMs and the first chunk show. NeMo's and Megatron-Bridge's pre-training performance recipes set
  it for TP > 1 (``MegatronCommOverlapCallback(tp_comm_overlap=True)`` with a userbuffers config per
  model in NeMo 2; ``CommOverlapConfig(tp_comm_overlap=True)`` in Megatron-Bridge's performance
  configs); Megatron-LM leaves ``--tp-comm-overlap`` off by default; torchtitan's async TP is opt-in
  (``enable_async_tensor_parallel``, with compile) and off by default; DeepSpeed and llm-foundry have none.
  ``ParallelConfig.tp_overlap`` overrides the stack's default for one run.
* Data-parallel overlap (bucketed gradient reduce-scatter behind the backward, parameter all-gather
  behind the forward) and pipeline send/recv (exposed) are modelled the same for every stack here: each
  stack named has them on by default (Megatron's ``--overlap-grad-reduce``/``--overlap-param-gather``
  in the recipes that set them, FSDP's prefetch).
* ``pp_async``: pipeline sends and receives posted asynchronously, each hidden behind the stage's next
  micro-batch but for the pp - 1 hops each way that fill and drain the pipeline. Llama 3's training
  stack does it ("we adopt asynchronous point-to-point communication in PP", arXiv:2407.21783, section
  3.3.2; its corpus rows carry ``pp_async``); no profiled stack is given it by default.
* Dispatch overlap and the cost of overlapped communication are properties of the device
  (``Compute.async_dispatch``, ``Compute.overlap_slowdown``), not of the stack.

Profiles are chosen from each framework's documented defaults, not fitted to the published runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuyard.errors import NotFoundError

# Memory traffic of a Llama block's memory-bound operators in eager PyTorch against the step model's
# count (ELEMENTWISE_BYTES_PER_H): RMSNorm upcast to fp32 and computed in five passes (about 44 bytes
# per element against 4), RoPE through complex fp32 views on q and k, SwiGLU as silu then multiply, and
# the residual adds; counted per token and layer this is about 2.2 times the fused count.
EAGER_LLAMA_ELEMENTWISE = 2.2
# Transformer Engine's grouped GEMM (GroupedLinear -> general_grouped_gemm -> nvte_multi_stream_cublas_gemm)
# issues one cuBLASLt GEMM per expert, round-robin over CUDA streams. Its cost per expert GEMM where the
# arithmetic is negligible: 0.267 ms for 8 experts of 128 tokens, N = K = 2048, on an SM100 (B200), the
# GEMMs alone (operands pre-swizzled), against 0.069 ms for one CUTLASS kernel doing the same 8
# (NVIDIA/TransformerEngine PR #3134, "Single-launch CUTLASS grouped GEMM for per-tensor NVFP4", its
# TN fprop table): 0.267 / 8 = 33.4 us per expert GEMM, of which the 1.1 GFLOP each takes about 1 us.
# The loop, the cuBLASLt calls and the stream hand-offs are per GEMM whatever the dtype.
TE_MULTI_STREAM_GEMM_US = 33.4
# Attention kernel families, oldest first (see ``attention`` in the module docstring).
ATTENTION_FAMILIES = ("unfused", "fa1", "fa2", "fa3", "cudnn")


@dataclass(frozen=True)
class Stack:
    """One training stack's profile (see the module docstring for each field's derivation)."""

    name: str
    optimizer_bytes_per_param: float
    elementwise_factor: float
    attention: str  # one of ATTENTION_FAMILIES
    summary: str
    fp32_elementwise: bool = False
    eager_elementwise: bool = False
    loss_bytes_per_logit: float = 24.0
    tp_comm_overlap: bool = False
    fused_loss: bool = False
    pp_scatter_gather: bool = False
    tp_overlap_scope: str = "all"  # "all" | "micro-pipeline" (see tp_comm_overlap in the module docstring)
    # "megatron" | "op" | "dots-except-mlpwi" | "dots" | "every-2nd-layer": what recompute="selective"
    # reruns (module docstring; "dots" is MaxText's remat_policy "minimal")
    selective: str = "megatron"
    dropout: float = 0.1  # hidden and attention dropout of the models it trains (memory: masks kept)
    grad_bytes: int = 4  # gradient bytes per parameter (buffer and reduction): fp32 (4) or bf16 (2)
    # The compiler rematerialises saved activations when the step's buffers exceed device memory (XLA's
    # HloRematerialization pass runs with the device's memory limit: openxla.org/xla, "HLO passes";
    # xla/service/hlo_rematerialization.h): a layout a little over the memory still compiles, and pays
    # for what it recomputes (gpuyard.fabric.step, _StepModel.remat_share).
    compiler_remat: bool = False
    # Activations of width h (a layer's input, the attention output projection's and the MLP output's) are
    # kept sharded over the tensor-parallel ranks, as Megatron's sequence parallelism keeps them, whatever
    # the layout's sequence_parallel says: MaxText's logical_axis_rules map 'activation_embed' to the
    # 'tensor' mesh axis (MaxText/configs/base.yml), so a saved (batch, length, embed) value is split over
    # it. Memory only (gpuyard.fabric.step_memory); the collectives are the layout's.
    activation_embed_sharded: bool = False
    # float8 scaling recipe of fp8 runs (torchao.float8): "tensorwise" (cuBLAS, one scale per tensor) or
    # "rowwise" (a CUTLASS kernel with a scale per row; gpuyard.fabric.step_layer, FP8_ROWWISE_GEMM).
    fp8_recipe: str = "tensorwise"
    # Dropless MoE layers synchronise the host with the device once per layer and micro-batch forward
    # (Megatron-Core's all-to-all token dispatcher hands Transformer Engine's GroupedLinear its per-expert
    # row counts as a host list, ``m_splits``), so the expert GEMMs' launches are not queued ahead
    # (gpuyard.fabric.step_layer). Megatron-Core and the stacks built on it (NeMo, Megatron-Bridge).
    moe_host_sync: bool = False
    # Host time to issue one expert GEMM of the stack's grouped-GEMM path on a CUDA device, where it
    # exceeds a plain kernel launch (gpuyard.fabric.step_layer, TE_MULTI_STREAM_GEMM_US: Transformer
    # Engine's GroupedLinear runs one cuBLASLt GEMM per expert over several CUDA streams). 0: a launch.
    expert_gemm_issue_us: float = 0.0
    # How MoE layers move tokens to their experts: "alltoall" (NCCL all-to-all of every routed copy, priced
    # by the collective model) or "hybridep" (DeepEP's Hybrid-EP kernels, Megatron-Core's flex dispatcher:
    # one copy per destination GPU at Hybrid-EP's measured bandwidth, gpuyard.fabric.step_layer).
    moe_dispatcher: str = "alltoall"
    # Pipeline sends and receives posted asynchronously, so a stage computes its next micro-batch while
    # the last one's activations (or gradients) cross: only the hops that fill and drain the pipeline wait
    # (gpuyard.fabric.step, _StepModel.terms). Llama 3's pipeline: "we adopt asynchronous point-to-point
    # communication in PP" (arXiv:2407.21783, section 3.3.2); no profiled stack turns it on by default.
    pp_async: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_FAMILIES:
            raise ValueError(f"stack {self.name}: attention {self.attention!r} not in {ATTENTION_FAMILIES}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"stack {self.name}: dropout {self.dropout} is not in [0, 1)")
        if self.fp8_recipe not in ("tensorwise", "rowwise"):
            raise ValueError(f"stack {self.name}: fp8_recipe {self.fp8_recipe!r} is not tensorwise/rowwise")
        if not 0 <= self.expert_gemm_issue_us < 1e4:
            got = self.expert_gemm_issue_us
            raise ValueError(f"stack {self.name}: expert_gemm_issue_us {got} is not in [0, 10000)")
        if self.moe_dispatcher not in ("alltoall", "hybridep"):
            got_d = self.moe_dispatcher
            raise ValueError(f"stack {self.name}: moe_dispatcher {got_d!r} is not alltoall or hybridep")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"stack {self.name}: grad_bytes {self.grad_bytes} is not 2 or 4")
        if self.tp_overlap_scope not in ("all", "micro-pipeline") or self.selective not in (
            "megatron",
            "op",
            "dots-except-mlpwi",
            "dots",
            "every-2nd-layer",
        ):
            raise ValueError(f"stack {self.name}: bad tp_overlap_scope or selective")


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(
            "megatron-lm",
            30.0,
            1.0,
            "cudnn",
            "Megatron-LM / Megatron-Core with Transformer Engine (cuDNN fused attention)",
            loss_bytes_per_logit=12.0,
            moe_host_sync=True,
            expert_gemm_issue_us=TE_MULTI_STREAM_GEMM_US,
        ),
        # Megatron-LM v2 (2021) and Megatron-DeepSpeed (MT-NLG, BLOOM, 2021-22): no FlashAttention; QK^T and
        # softmax x V as batched GEMMs over the whole s x s square, the fused scale-mask-softmax kernel
        # and attention dropout over the scores in memory; jit-fused bias+GELU and bias+dropout+add; apex
        # FusedAdam; vocab-parallel cross-entropy; pipeline sends split over the TP ranks (SC'21 4.1).
        Stack(
            "megatron-lm-2021",
            30.0,
            1.0,
            "unfused",
            "Megatron-LM v2 / Megatron-DeepSpeed (2021-22): unfused attention, scatter/gather pipeline sends",
            loss_bytes_per_logit=12.0,
            pp_scatter_gather=True,
        ),
        Stack(
            "nemo",
            30.0,
            1.0,
            "cudnn",
            "NVIDIA NeMo / Megatron-Bridge (Megatron-Core and TE underneath), TP comm overlap on",
            loss_bytes_per_logit=12.0,
            tp_comm_overlap=True,
            grad_bytes=2,
            moe_host_sync=True,
            expert_gemm_issue_us=TE_MULTI_STREAM_GEMM_US,
        ),
        Stack(
            "torchtitan",
            30.0,
            EAGER_LLAMA_ELEMENTWISE,
            "fa2",
            "torchtitan: FSDP2, fused AdamW, eager RMSNorm/RoPE/SwiGLU unless compiled, SDPA flash (FA2)",
            tp_overlap_scope="micro-pipeline",
            selective="op",
            dropout=0.0,
            eager_elementwise=True,
        ),
        # llm-foundry with flash-attn 2 (its `gpu-flash2` extra, `attn_impl: flash`). Older benchmark rows
        # ran FlashAttention 1 or its Triton port: the corpus marks them (runs.yaml, `attention: fa1`).
        Stack(
            "llm-foundry",
            80.0,
            1.0,
            "fa2",
            "MosaicML llm-foundry / Composer: FSDP1, flash-attn 2, fused norms and cross-entropy",
            fused_loss=True,
            dropout=0.0,
            eager_elementwise=True,
        ),
        Stack("deepspeed", 30.0, 1.0, "fa2", "DeepSpeed ZeRO with FusedAdam", eager_elementwise=True),
        # MaxText (JAX/XLA on TPU): optax AdamW compiled by XLA into fused passes (fp32 weight, gradient,
        # m, v read; weight, m, v written: 28 bytes, 30 with the bf16 copy), XLA-fused elementwise
        # operators, Pallas splash/flash attention (no FA2-on-Hopper penalty applies off NVIDIA).
        Stack(
            "maxtext",
            30.0,
            1.0,
            "fa3",
            "MaxText: JAX/XLA on TPU, optax AdamW, splash attention",
            loss_bytes_per_logit=12.0,
            dropout=0.0,
            # XLA on TPU: async collective fusion overlaps the sharded layers' collectives with their
            # matmuls (MaxText's runs set LIBTPU_INIT_ARGS --xla_tpu_enable_async_collective_fusion,
            # ..._fuse_all_gather, ..._multiple_steps and --xla_tpu_overlap_compute_collective_tc).
            tp_comm_overlap=True,
            # MaxText's "selective" is remat_policy save_dot_except_mlpwi (layers/decoders.py,
            # get_remat_policy: query/key/value/out projections and mlpwo saved, mlpwi recomputed).
            selective="dots-except-mlpwi",
            compiler_remat=True,
            activation_embed_sharded=True,
        ),
        Stack("other", 30.0, 1.0, "fa3", "a stack the corpus does not profile: fused optimizer and kernels"),
        Stack(
            "gpuyard",
            30.0,
            1.0,
            "fa3",
            "gpuyard's trainer: eager PyTorch, autocast (fp32 norms), fused AdamW, SDPA",
            fp32_elementwise=True,
            dropout=0.0,
            eager_elementwise=True,
        ),
    )
}


def get_stack(name: str) -> Stack:
    """The profile of a stack by name.

    Raises:
        NotFoundError: the message lists the known stacks.
    """
    try:
        return STACKS[name]
    except KeyError:
        raise NotFoundError(f"unknown software stack {name!r}; known: {', '.join(STACKS)}") from None
