"""Parallelism planner: search tp x pp x dp x cp layouts and memory knobs, rank by throughput.

Knobs the user fixes are held; the others are searched. Layouts that do not fit in device memory are
dropped before their time is modelled (memory is cheap to model, time less so), which keeps the full
search for a 405B model on 16,384 GPUs under half a second of CPU time. One step model serves the
whole search (gpuyard.fabric.step.step_model): the terms layouts share are computed once per distinct
knob values, and full estimates are built only for the plans returned.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.failures import LLAMA3_405B, EttrPlan, FailureModel, plan_ettr
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.published.ceilings import mfu_warning
from gpuyard.fabric.stacks import STACKS, get_stack
from gpuyard.fabric.step import (
    GIB,
    PRECISIONS,
    RECOMPUTE,
    ParallelConfig,
    StepEstimate,
    step_model,
    validate,
)
from gpuyard.fabric.torus import group_shape

MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (1, 2, 4, 8)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Knobs:
    """Knobs a user can hold fixed; None means "search it"."""

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    micro_batch: int | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    zero: int | None = None
    sequence_parallel: bool | None = None
    ep: int | None = None
    precision: str = "bf16"  # the run's precision: held, never searched
    stack: str = "megatron-lm"  # the software-stack profile (gpuyard.fabric.stacks): held, never searched

    def fixed(self) -> bool:
        """True when every knob is given (a single layout to check); ep may stay unset (it defaults to 1)."""
        return all(
            getattr(self, k) is not None
            for k in self.__dataclass_fields__
            if k not in ("ep", "precision", "stack")
        )


@dataclass(frozen=True)
class PlanResult:
    """Ranked plans and what the search saw."""

    plans: list[StepEstimate]
    considered: int
    fitting: int
    warnings: list[str] = field(default_factory=list)

    def explain(self) -> str:
        """Why the top plan wins, in two sentences."""
        if not self.plans:
            return "no plan"
        top = self.plans[0]
        b, step = top.breakdown, top.step_time_s
        text = (
            f"The top plan reaches {top.mfu:.0%} MFU: {b.compute_s / step:.0%} of the step computes, "
            f"{b.bubble_s / step:.0%} is pipeline bubble and {b.exposed_comm_s / step:.0%} waits on "
            f"communication."
        )
        if len(self.plans) > 1:
            second = self.plans[1]
            gaps = {
                "compute": second.breakdown.compute_s - b.compute_s,
                "the pipeline bubble": second.breakdown.bubble_s - b.bubble_s,
                "exposed communication": second.breakdown.exposed_comm_s - b.exposed_comm_s,
            }
            why = max(gaps, key=lambda k: gaps[k])
            lead = second.step_time_s / step - 1
            if _rank_key(top)[0] == _rank_key(second)[0]:
                text += (
                    f" It ties with the next plan to 4 significant digits ({_differences(top, second)}); "
                    "the tie goes to the plan using less memory, then to the simpler layout."
                )
            elif lead < 0.005:
                text += (
                    f" It is only {lead:.1%} faster than the next plan ({_differences(top, second)}), far "
                    "inside the model's 10% accuracy: either will do."
                )
            else:
                text += (
                    f" It is {lead:.1%} faster than the next plan, mostly through less {why} "
                    f"({gaps[why]:.3f} s per step)."
                )
        return text


def _differences(a: StepEstimate, b: StepEstimate) -> str:
    """What separates two plans: the knobs that differ and, when the work per GPU is the same, why."""
    names = {"micro_batch": "micro-batch", "virtual_stages": "virtual stages", "sequence_parallel": "sp"}
    differ = [k for k in a.config.__dataclass_fields__ if getattr(a.config, k) != getattr(b.config, k)]
    text = ", ".join(f"{names.get(k, k)} {getattr(a.config, k)} vs {getattr(b.config, k)}" for k in differ)
    same_tokens = a.config.micro_batch / a.config.cp == b.config.micro_batch / b.config.cp
    # Trading data for context parallelism at equal tokens per GPU keeps the compute and the sharding
    # group: only ring-attention traffic separates the two, which is small next to a step.
    if differ and same_tokens and set(differ) <= {"cp", "dp", "micro_batch"}:
        text += (
            "; every GPU runs the same tokens per micro-batch through the same layers, so only the "
            f"communication differs ({a.breakdown.exposed_comm_s:.2f} vs "
            f"{b.breakdown.exposed_comm_s:.2f} s exposed)"
        )
    return text or "same knobs"


def _rank_key(e: StepEstimate) -> tuple[float, ...]:
    """Throughput first (4 significant digits: closer is noise); ties go to less memory, then to the
    simpler layout (less context parallelism, fewer virtual stages, shorter pipelines, narrower tensor).
    """
    return _rank(e.tokens_per_s, e.memory_gib_per_gpu, e.config)


def _rank(tokens_per_s: float, memory_gib: float, c: ParallelConfig) -> tuple[float, ...]:
    """:func:`_rank_key` from a plan's figures (the search ranks before it builds the estimates)."""
    return (-float(f"{tokens_per_s:.4g}"), round(memory_gib, 1), c.cp, c.virtual_stages, c.pp, c.tp)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _tensor_sizes(model: ModelSpec, cluster: Cluster, knobs: Knobs) -> list[int]:
    if knobs.tp is not None:
        return [knobs.tp]
    # Tensor parallelism outside the NVLink domain is never worth modelling: keep it inside.
    sizes = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cluster.domain and model.heads % t == 0]
    return [t for t in sizes if model.kv_heads % t == 0 or t % model.kv_heads == 0]


def layouts(
    model: ModelSpec, cluster: Cluster, gpus: int, global_batch: int, seq_len: int, knobs: Knobs
) -> Iterator[ParallelConfig]:
    """Every layout consistent with the fixed knobs, the GPU count and the batch (memory not yet checked)."""
    for knob_values in _layout_knobs(model, cluster, gpus, global_batch, seq_len, knobs):
        yield ParallelConfig(*knob_values, knobs.precision, knobs.stack)


# (tp, pp, dp, cp, micro_batch, virtual_stages, recompute, zero, sequence_parallel, ep): ParallelConfig's
# leading fields, in order. The search keeps layouts in this form until they fit in memory.
_Knobs = tuple[int, int, int, int, int, int, str, int, bool, int]


def _layout_knobs(
    model: ModelSpec, cluster: Cluster, gpus: int, global_batch: int, seq_len: int, knobs: Knobs
) -> Iterator[_Knobs]:
    """:func:`layouts` as tuples of ParallelConfig's leading fields, in the same order."""
    # A TPU slice trains with data, FSDP (ZeRO-3) and tensor sharding over its torus (MaxText's ici_*
    # axes): no pipeline, context parallelism or interleaving is searched there.
    tpu = cluster.torus is not None
    recomputes = [knobs.recompute] if knobs.recompute is not None else RECOMPUTE
    for tp in _tensor_sizes(model, cluster, knobs):
        sps = [knobs.sequence_parallel] if knobs.sequence_parallel is not None else [False, True]
        if tp == 1:
            sps = [False]
        for cp in [knobs.cp] if knobs.cp is not None else (1,) if tpu else CONTEXT_PARALLEL:
            if gpus % (tp * cp) or (cp > 1 and seq_len % (2 * cp)):
                continue
            rest = gpus // (tp * cp)
            for pp in [knobs.pp] if knobs.pp is not None else [1] if tpu else _divisors(rest, model.layers):
                if rest % pp:
                    continue
                dp = rest // pp
                if global_batch % dp:
                    continue
                per_replica = global_batch // dp
                # Without data-parallel peers every ZeRO stage is the same layout: search only stage 0.
                zeros = [knobs.zero] if knobs.zero is not None else (0, 1, 2, 3) if dp * cp > 1 else (0,)
                experts = _expert_sizes(model, dp, knobs)
                for mb in [knobs.micro_batch] if knobs.micro_batch is not None else MICRO_BATCHES:
                    if per_replica % mb:
                        continue
                    m = per_replica // mb
                    for v in [knobs.virtual_stages] if knobs.virtual_stages is not None else VIRTUAL_STAGES:
                        if v > 1 and (pp == 1 or m % pp or pp * v > model.layers):
                            continue
                        for ep in experts:
                            for rc in recomputes:
                                for zero in zeros:
                                    for sp in sps:
                                        yield tp, pp, dp, cp, mb, v, rc, zero, sp, ep


def _expert_sizes(model: ModelSpec, dp: int, knobs: Knobs) -> list[int]:
    if knobs.ep is not None:
        return [knobs.ep] if knobs.ep == 1 or (model.is_moe and dp % knobs.ep == 0) else []
    if not model.is_moe:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if model.experts % e == 0 and dp % e == 0]


def _check_fixed(model: ModelSpec, cluster: Cluster, gpus: int, seq_len: int, knobs: Knobs) -> None:
    """Reject fixed knobs that can never work, with the reason (before any search)."""
    cluster.check_gpus(gpus)
    for name in ("tp", "pp", "cp", "micro_batch", "virtual_stages", "ep"):
        value = getattr(knobs, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {value}")
    if knobs.zero is not None and knobs.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {knobs.zero}")
    if knobs.tp is not None and model.heads % knobs.tp:
        raise ConfigError(
            f"tensor-parallel size {knobs.tp} does not divide the {model.heads} heads of {model.name}"
        )
    fixed = (knobs.tp or 1) * (knobs.pp or 1) * (knobs.cp or 1)
    if gpus % fixed:
        raise ConfigError(f"{gpus} GPUs are not divisible by tp x pp x cp = {fixed}")
    if knobs.recompute is not None and knobs.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {knobs.recompute!r}")
    if knobs.ep is not None and knobs.ep > 1 and (not model.is_moe or model.experts % knobs.ep):
        raise ConfigError(
            f"expert-parallel size {knobs.ep} needs a mixture-of-experts model with experts divisible by it"
            f" ({model.name} has {model.experts})"
        )
    if cluster.torus is not None and gpus < cluster.domain:
        try:
            group_shape(cluster.torus, gpus)
        except ConfigError:
            dims = "x".join(map(str, cluster.torus.dims))
            raise ConfigError(
                f"{gpus} chips are not a block of the {dims} torus of {cluster.name!r}: a TPU slice is a "
                "block of whole dimensions' divisors (e.g. 8, 16, 32, 64 chips)"
            ) from None
    if cluster.torus is not None and ((knobs.pp or 1) > 1 or (knobs.cp or 1) > 1):
        raise ConfigError(
            f"{cluster.name!r} is a TPU slice: gpuyard plans data, FSDP and tensor sharding on it; "
            "pipeline and context parallelism are not modelled there (drop --pp/--cp)"
        )
    if knobs.stack not in STACKS:
        raise ConfigError(f"unknown software stack {knobs.stack!r}; known: {', '.join(STACKS)}")
    if knobs.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {knobs.precision!r}")
    if knobs.zero is not None and knobs.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {knobs.zero}")
    if knobs.cp is not None and knobs.cp > 1 and seq_len % (2 * knobs.cp):
        raise ConfigError(
            f"context-parallel size {knobs.cp} needs seq_len {seq_len} divisible by {2 * knobs.cp}"
        )


def plan(
    model: ModelSpec,
    cluster: Cluster,
    gpus: int,
    global_batch: int,
    seq_len: int | None = None,
    knobs: Knobs | None = None,
    top: int = 5,
) -> PlanResult:
    """Search layouts for training ``model`` on ``gpus`` GPUs and rank those that fit by throughput.

    Args:
        model: the transformer.
        cluster: the cluster.
        gpus: GPUs to use.
        global_batch: sequences per step.
        seq_len: tokens per sequence (default: the model's).
        knobs: knobs to hold fixed.
        top: plans to return.

    Raises:
        ConfigError: a fixed knob is invalid, or no layout is consistent with the knobs and the batch.
        CapacityError: layouts exist but none fits in device memory (the message gives the smallest need).
    """
    knobs = knobs or Knobs()
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"sequence length must be at least 1, got {seq_len}")
    seq = seq_len or model.seq_len
    if global_batch < 1 or top < 1:
        raise ConfigError(f"global batch and top must be at least 1, got {global_batch} and {top}")
    _check_fixed(model, cluster, gpus, seq, knobs)
    limit = cluster.device_memory_bytes
    considered, smallest = 0, float("inf")
    # One step model for the whole search: the terms layouts share are computed once and looked up.
    steps = step_model(model, cluster, gpus, global_batch, seq, knobs.precision, get_stack(knobs.stack))
    memory, step_terms = steps.memory.parts, steps.terms
    remat = steps.profile.compiler_remat
    tokens = global_batch * seq
    # (rank, layout, micro-batches, memory by kind) of each layout that fits; estimates are built for the
    # top ones only, from the same step model (so equal to what estimate_step gives each layout).
    fitting: list[tuple[tuple[float, ...], ParallelConfig, int, dict[str, float]]] = []
    search = _layout_knobs(model, cluster, gpus, global_batch, seq, knobs)
    for tp, pp, dp, cp, mb, v, rc, zero, sp, ep in search:
        considered += 1
        m = global_batch // (dp * mb)
        weights, grads, optim, acts = memory(tp, pp, dp, cp, mb, v, rc, zero, sp, ep, m)
        need = steps.needed(weights + grads + optim + acts)
        if need < smallest:
            smallest = need
        cfg = None
        if need <= limit:  # memory first: only the layouts that fit have their time modelled
            cfg = ParallelConfig(tp, pp, dp, cp, mb, v, rc, zero, sp, ep, knobs.precision, knobs.stack)
            step_s = step_terms(cfg, m).step
        elif remat:  # a compiler that rematerialises to fit (XLA) still runs it, slower
            cfg = ParallelConfig(tp, pp, dp, cp, mb, v, rc, zero, sp, ep, knobs.precision, knobs.stack)
            share = steps.remat_share(cfg, m, need, acts)
            if share is None:
                cfg = None
            else:
                step_s, need = steps.step_after_remat(cfg, m, share).step, float(limit)
        if cfg is not None:
            validate(model, gpus, global_batch, seq, cfg)
            rank = _rank(tokens / step_s, need / GIB, cfg)
            mem = {"weights": weights, "grads": grads, "optimizer": optim, "activations": acts}
            fitting.append((rank, cfg, m, mem))
    if not considered:
        if knobs.fixed():  # the fixed layout's own check says precisely what is wrong
            dp = gpus // ((knobs.tp or 1) * (knobs.pp or 1) * (knobs.cp or 1))
            validate(
                model, gpus, global_batch, seq, ParallelConfig(dp=dp, **{**vars(knobs), "ep": knobs.ep or 1})
            )
        raise ConfigError(
            f"no tp x pp x dp x cp layout of {gpus} GPUs divides global batch {global_batch} "
            f"with the knobs given"
        )
    if not fitting:
        what = (
            "the fixed plan needs"
            if knobs.fixed()
            else f"none of {considered} layouts fits: the smallest needs"
        )
        raise CapacityError(
            f"{what} {smallest / GIB:.1f} GiB per GPU; {cluster.device_name} has {limit / GIB:.1f} GiB"
        )
    fitting.sort(key=itemgetter(0))  # stable: equal ranks keep the search's order
    chosen = [steps.estimate(cfg, m, mem) for _, cfg, m, mem in fitting[:top]]
    warnings = []
    if chosen:  # the MFU sanity rule: no plan is believed faster than any published run on the device
        warning = mfu_warning(cluster.device_name, chosen[0].config.precision, chosen[0].mfu, model, seq)
        if warning:
            warnings.append(f"top plan: {warning}")
    return PlanResult(plans=chosen, considered=considered, fitting=len(fitting), warnings=warnings)


# -- expected ETTR at the planned scale (gpuyard.fabric.failures) -------------------------------------

# Checkpointed training state per parameter: 16-bit weights, FP32 master weights, Adam's two moments.
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 8
# Write bandwidth a node gets to checkpoint storage, and the storage's own limit (GB/s). The storage
# figure is Llama 3's Tectonic: 2 TB/s sustained (The Llama 3 Herd of Models, section 3.3.1); the
# per-node figure is an assumption (a shared file system client), to be replaced by a measured one.
WRITE_GBPS_PER_NODE = 2.0
STORAGE_GBPS = 2000.0
# Failure to training again: detection (a collective's timeout), rescheduling, loading the
# checkpoint, warming up. An assumption; Llama 3 names reducing it without giving a figure.
RESTART_S = 600.0


def checkpoint_stall_s(
    model: ModelSpec,
    gpus: int,
    gpus_per_node: int,
    write_gbps_per_node: float = WRITE_GBPS_PER_NODE,
    storage_gbps: float = STORAGE_GBPS,
) -> float:
    """The training stall of one synchronous checkpoint: the state's bytes over the write bandwidth
    (every node writes its share at once, up to the storage's limit)."""
    nodes = -(-gpus // gpus_per_node)
    bandwidth = min(nodes * write_gbps_per_node, storage_gbps) * 1e9
    return model.params * CHECKPOINT_BYTES_PER_PARAM / bandwidth


def expected_ettr(
    model: ModelSpec,
    cluster: Cluster,
    gpus: int,
    checkpoint_s: float | None = None,
    restart_s: float = RESTART_S,
    failures: FailureModel = LLAMA3_405B,
) -> EttrPlan:
    """Expected ETTR of training ``model`` on ``gpus`` GPUs of ``cluster``, per checkpoint interval and at
    the best one (see :mod:`gpuyard.fabric.failures`).

    Args:
        checkpoint_s: the stall per checkpoint (default: :func:`checkpoint_stall_s`).
        restart_s: failure to training again.
        failures: GPU and node failure rates (default: the Llama 3 405B run's).
    """
    notes: list[str] = []
    if checkpoint_s is None:
        checkpoint_s = checkpoint_stall_s(model, gpus, cluster.gpus_per_node)
        notes.append(
            f"checkpoint stall: {model.params * CHECKPOINT_BYTES_PER_PARAM / 1e12:.2f} TB of state at "
            f"{WRITE_GBPS_PER_NODE:g} GB/s per node (at most {STORAGE_GBPS:g} GB/s)"
        )
    return plan_ettr(gpus, cluster.gpus_per_node, checkpoint_s, restart_s, failures, notes=tuple(notes))
