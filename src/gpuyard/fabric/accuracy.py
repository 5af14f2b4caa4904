"""The step model against the published corpus: each run's published step time, its prediction, the error.

A published figure becomes a step time without gpuyard's own FLOP count: tokens/s and step times are
used as they are; TFLOP/s figures are turned back into seconds with the source's own convention
(``Source.flop_convention``). The prediction uses the run's cluster preset with the run's device, the
run's layout, precision and the software stack of its source (:mod:`gpuyard.fabric.stacks`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster, Compute
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.published.runs import PublishedRun, Source, load_runs, load_sources, model_spec
from gpuyard.fabric.stacks import Stack, get_stack
from gpuyard.fabric.step import estimate_step


def flops_per_step(run: PublishedRun, model: ModelSpec, convention: str) -> float:
    """FLOPs of one step as the source counts them (the numerator of its TFLOP/s figure).

    Raises:
        ConfigError: a convention this module does not know.
    """
    tokens = run.tokens_per_step
    s, n, h, v = run.seq_len, model.layers, model.hidden, model.vocab
    if convention == "megatron-eq3":  # Narayanan et al. SC'21, equation 3 (full recomputation counted)
        return 96 * run.global_batch * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    if convention == "6N":
        return 6 * model.params * tokens
    if convention in ("6N+attn", "mosaic-mfu"):
        return model.model_flops_per_token(s) * tokens
    if convention == "6N+attn-causal":
        return model.model_flops_per_token(s, causal=True) * tokens
    raise ConfigError(f"FLOP convention {convention!r} is not known to gpuyard.fabric.accuracy")


def published_step_s(run: PublishedRun, source: Source) -> float:
    """The step time the source's figure implies (seconds)."""
    direct = run.direct_step_time_s()
    if direct is not None:
        return direct
    model = model_spec(run)
    flops = flops_per_step(run, model, source.flop_convention)
    if run.metric == "tflops_per_gpu":
        return flops / (run.gpus * run.value * 1e12)
    raise ConfigError(f"{run.id}: metric {run.metric} needs a peak convention this module does not apply")


@lru_cache(maxsize=64)
def run_cluster(preset: str, device: str) -> Cluster:
    """The run's cluster preset with the run's accelerator (e.g. A100 40GB on the DGX A100 fabric)."""
    cluster = load_cluster(preset)
    if cluster.accelerator == device:
        return cluster
    return Cluster.model_validate({**cluster.model_dump(), "accelerator": device})


@dataclass(frozen=True)
class RunError:
    """One run's published and predicted step time; error = predicted / published - 1."""

    run: PublishedRun
    published_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Signed relative error (positive: predicted slower than published)."""
        return self.predicted_s / self.published_s - 1


# ----- fitting and leave-one-source-out -------------------------------------------------------------

# The one constant fitted to published runs: the large-GEMM efficiency in training, per GPU generation
# (NVLink generation in the catalog: 3 Ampere, 4 Hopper, 5 Blackwell). Everything else in the model is
# derived from datasheets, kernel papers, framework defaults or measurement.
EFFICIENCY_GRID = tuple(round(0.30 + 0.01 * i, 2) for i in range(66))  # 0.30 .. 0.95


def generation(device: str) -> str:
    """The GPU generation whose GEMM efficiency a device shares."""
    from gpuyard.hardware.catalog import get_spec

    gen = get_spec(device).nvlink_generation
    return {3: "ampere", 4: "hopper", 5: "blackwell"}.get(gen or 0, device)


def efficiency_class(run: PublishedRun) -> str:
    """The group of rows that share one fitted GEMM efficiency: the generation, and the power limit.

    A GPU held below its rated power sustains lower clocks under dense GEMMs than the same GPU at its
    TDP, so its efficiency is its own constant: torchtitan's Grand Teton H100s run at "the default 500W
    power limit, although tuning it up to 700W TDP can potentially provide further speedups"
    (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md and
    asyncTP_llama3_h100_2025-06_torchtitan.md, Hardware sections). ``hopper@500W`` is fitted like a
    generation, without the source being judged; held out with no other source at that limit, it
    borrows its generation's fit (:func:`borrowed_generation`).
    """
    gen = generation(run.device)
    return gen if run.power_limit_w is None else f"{gen}@{run.power_limit_w:g}W"


@lru_cache(maxsize=4096)
def _cluster_with(
    preset: str, device: str, efficiency: float | None, memory_bw_GBps: float | None = None
) -> Cluster:
    cluster = run_cluster(preset, device)
    if efficiency is None and memory_bw_GBps is None:
        return cluster
    data = cluster.model_dump()
    if efficiency is not None:
        data["compute"] = {**data["compute"], "gemm_efficiency": efficiency}
    if memory_bw_GBps is not None:  # the source's own GPUs differ from the catalog entry
        data["compute"] = {**data["compute"], "datasheet_memory_bw_GBps": memory_bw_GBps}
    return Cluster.model_validate(data)


def predict_at(run: PublishedRun, stack: Stack, efficiency: float | None) -> float:
    """Predicted step seconds with the generation's GEMM efficiency set to ``efficiency`` (None: preset's)."""
    if run.attention is not None and run.attention != stack.attention:
        stack = replace(stack, attention=run.attention)  # the kernel family the source documents
    if run.fp8_recipe is not None and run.fp8_recipe != stack.fp8_recipe:
        stack = replace(stack, fp8_recipe=run.fp8_recipe)  # the float8 recipe the source names
    if run.moe_dispatcher is not None and run.moe_dispatcher != stack.moe_dispatcher:
        stack = replace(stack, moe_dispatcher=run.moe_dispatcher)  # the MoE dispatcher its recipe runs
    if run.selective is not None and run.selective != stack.selective:
        stack = replace(stack, selective=run.selective)  # the selective checkpointing the source ran
    if run.pp_async is not None and run.pp_async != stack.pp_async:
        stack = replace(stack, pp_async=run.pp_async)  # asynchronous pipeline sends the source describes
    cfg = replace(run.parallel_config(), stack=stack.name)
    cluster = _cluster_with(run.cluster, run.device, efficiency, run.memory_bw_GBps)
    return estimate_step(
        model_spec(run), cluster, run.gpus, run.global_batch, run.seq_len, cfg, stack=stack
    ).step_time_s


@dataclass
class Corpus:
    """The published runs with their published step times, and a cache of predictions by efficiency."""

    runs: list[PublishedRun]
    sources: dict[str, Source]
    published: dict[str, float]
    _cache: dict[tuple[str, float | None], float]

    @classmethod
    def load(cls) -> Corpus:
        """The packaged corpus."""
        sources = load_sources()
        runs = load_runs()
        return cls(runs, sources, {r.id: published_step_s(r, sources[r.source]) for r in runs}, {})

    def predicted(self, run: PublishedRun, efficiency: float | None) -> float:
        """Predicted step seconds of ``run`` at ``efficiency`` (memoised)."""
        key = (run.id, efficiency)
        if key not in self._cache:
            self._cache[key] = predict_at(run, get_stack(self.sources[run.source].stack), efficiency)
        return self._cache[key]

    def log_error(self, run: PublishedRun, efficiency: float | None) -> float:
        """|ln(predicted / published)|: symmetric, so fits do not favour predicting slow or fast."""
        import math

        return abs(math.log(self.predicted(run, efficiency) / self.published[run.id]))


def fit_efficiencies(corpus: Corpus, sources: set[str]) -> dict[str, float]:
    """Per generation, the GEMM efficiency minimising the mean over ``sources`` of each source's median error.

    Each source weighs the same however many rows it has (one framework table of 216 rows must not
    outvote eight papers). A generation no training source measures gets no entry (its preset holds).
    """
    fitted = {}
    rows = [r for r in corpus.runs if r.source in sources]
    for gen in sorted({efficiency_class(r) for r in rows}):
        mine = [r for r in rows if efficiency_class(r) == gen]
        by_source: dict[str, list[PublishedRun]] = {}
        for r in mine:
            by_source.setdefault(r.source, []).append(r)

        def score(eff: float, groups: dict[str, list[PublishedRun]] = by_source) -> float:
            return sum(statistics.median(corpus.log_error(r, eff) for r in g) for g in groups.values())

        fitted[gen] = min(EFFICIENCY_GRID, key=score)
    return fitted


# GPU generations in release order: a generation no training source measures borrows the fit of the
# nearest one in this order (the older one on a tie).
GENERATION_ORDER = ("ampere", "hopper", "blackwell")
# GEMM efficiency of a device that no training source measures and that has no GPU generation to
# borrow from (a TPU whose only source is held out): the schema's default, an assumption.
UNFITTED_EFFICIENCY = Compute().gemm_efficiency


def borrowed_generation(gen: str, fitted: dict[str, float]) -> str | None:
    """The fitted generation whose efficiency ``gen`` uses: itself, else the nearest fitted one.

    None where ``gen`` is not one of the fitted generations (e.g. an Ada card whose preset value is
    assumed, not fitted to the corpus): the preset then holds, and it carries no corpus figure.
    """
    if gen in fitted:
        return gen
    if "@" in gen:  # a power-limited class no other source measures: its generation's fit first
        return borrowed_generation(gen.split("@", 1)[0], fitted)
    if gen not in GENERATION_ORDER:
        return None
    here = GENERATION_ORDER.index(gen)
    candidates = [g for g in GENERATION_ORDER if g in fitted]
    if not candidates:
        return None
    return min(candidates, key=lambda g: (abs(GENERATION_ORDER.index(g) - here), GENERATION_ORDER.index(g)))


# Large bf16 GEMM efficiency per GPU generation measured outside the corpus, as a share of the dense
# datasheet peak, with the step model's shape law divided out (the asymptote a large GEMM tends to):
# Hopper 0.72, `gpuyard fabric calibrate` on an H100 SXM (710.5-721.4 of 989.5 TFLOP/s in two runs,
# BENCHMARKS.md "Fabric: calibration on an H100"); Blackwell 0.71, vLLM's benchmarks/kernels/
# bench_fp8_gemm.py on a B200 (torch-bf16, i.e. cuBLAS, at M 16,384, N 6,144, K 4,096: 1,512.8 of
# 2,250 TFLOP/s, vllm-project/vllm PR #19566; its first run, PR #18778, 1,433.0 at M 1,024), the shape
# law's 0.944 at that shape divided out. A generation no other source measures borrows the nearest
# generation's fit scaled by the ratio of the two: the fit carries what the corpus's stacks lose to
# cuBLAS, the ratio what the newer device's GEMMs lose to its datasheet (0.98: the B200 reaches a hair
# less of its peak than the H100, and not the H100's share of it exactly).
MEASURED_GEMM_EFFICIENCY = {"hopper": 0.72, "blackwell": 0.71}


def borrowed_efficiency(gen: str, fitted: dict[str, float]) -> float | None:
    """The GEMM efficiency rows of ``gen`` are predicted with under ``fitted``: its own fit, else the nearest
    generation's (:func:`borrowed_generation`) scaled by :data:`MEASURED_GEMM_EFFICIENCY` where both
    generations have a measurement outside the corpus; None where ``gen`` is not a fitted generation."""
    near = borrowed_generation(gen, fitted)
    if near is None:
        return None
    eff = fitted[near]
    mine, theirs = gen.split("@", 1)[0], near.split("@", 1)[0]
    if mine != theirs and mine in MEASURED_GEMM_EFFICIENCY and theirs in MEASURED_GEMM_EFFICIENCY:
        eff *= MEASURED_GEMM_EFFICIENCY[mine] / MEASURED_GEMM_EFFICIENCY[theirs]
    return eff


def _fitted_generations(corpus: Corpus) -> set[str]:
    """Generations whose preset GEMM efficiency is fitted to the whole corpus (never used held out)."""
    return {efficiency_class(r) for r in corpus.runs if generation(r.device) in GENERATION_ORDER}


def errors_with(corpus: Corpus, runs: list[PublishedRun], fitted: dict[str, float]) -> list[RunError]:
    """RunErrors of ``runs`` under the fitted efficiencies.

    A generation of the corpus that ``fitted`` lacks takes the nearest fitted generation's value, scaled
    by the measured GEMM efficiencies (:func:`borrowed_efficiency`), never its preset: the preset is
    fitted on every source, so using it for a held-out source would predict that source with a constant
    fitted on itself.
    """
    out = []
    corpus_gens = _fitted_generations(corpus)
    for r in runs:
        gen = efficiency_class(r)
        if gen in fitted:
            eff: float | None = fitted[gen]
        elif gen in corpus_gens:
            eff = borrowed_efficiency(gen, fitted)
            if eff is None:
                raise ConfigError(f"{r.id}: no fitted GPU generation to predict a {gen} run with")
        elif any(efficiency_class(x) == gen for x in corpus.runs):
            # A TPU (no GPU generation to borrow from) whose preset is fitted to the corpus, its own
            # source included: held out, it takes the unfitted default instead, never its own fit.
            eff = UNFITTED_EFFICIENCY
        else:
            eff = None  # a preset value not fitted to the corpus (assumed)
        out.append(RunError(r, corpus.published[r.id], corpus.predicted(r, eff)))
    return out


@dataclass(frozen=True)
class HeldOut:
    """One source predicted from a fit on every other source."""

    source: str
    fit: dict[str, float]
    errors: list[RunError]
    borrowed: dict[str, str]  # generation of its rows -> fitted generation used (only where they differ)

    def rows(self, borrowed: bool) -> list[RunError]:
        """Its rows whose generation was fitted without it (False) or borrowed from another (True)."""
        return [e for e in self.errors if (efficiency_class(e.run) in self.borrowed) == borrowed]


def leave_one_source_out(corpus: Corpus, only: str | None = None) -> dict[str, HeldOut]:
    """For each source (or ``only`` that one): fit on every other source, predict it with that fit only.

    A generation only the held-out source measures (Blackwell in megatron-bridge-25.11) takes the
    nearest generation's fit, scaled by the measured GEMM efficiencies (:func:`borrowed_efficiency`),
    and :attr:`HeldOut.borrowed` says which.
    """
    names = sorted(corpus.sources)
    out = {}
    for held in names if only is None else [only]:
        fit = fit_efficiencies(corpus, set(names) - {held})
        mine = [r for r in corpus.runs if r.source == held]
        borrowed = {}
        for gen in sorted({efficiency_class(r) for r in mine} & _fitted_generations(corpus)):
            near = borrowed_generation(gen, fit)
            if near is not None and near != gen:
                borrowed[gen] = near
        out[held] = HeldOut(held, fit, errors_with(corpus, mine, fit), borrowed)
    return out


@dataclass(frozen=True)
class SourceFigure:
    """One held-out source as a user meets it: the median and worst of its rows' |error|, its bias."""

    source: str
    runs: int
    median_pct: float
    worst_pct: float
    bias_pct: float  # median signed error (negative: predicted fast)


@dataclass(frozen=True)
class PerSource:
    """Every source held out in turn, each weighing the same whatever its number of rows."""

    sources: list[SourceFigure]

    @property
    def median_pct(self) -> float:
        """The median over sources of each held-out source's median |error|."""
        return statistics.median(s.median_pct for s in self.sources)

    @property
    def worst(self) -> SourceFigure:
        """The source with the largest held-out median |error|."""
        return max(self.sources, key=lambda s: (s.median_pct, s.source))


def per_source(held: dict[str, HeldOut]) -> PerSource:
    """The per-source figures of a leave-one-source-out run (:func:`leave_one_source_out`).

    Raises:
        ConfigError: a held-out source with no rows (its median would be undefined).
    """
    out = []
    for name in sorted(held):
        errors = held[name].errors
        if not errors:
            raise ConfigError(f"source {name} has no rows to judge it by")
        values = [abs(e.error) * 100 for e in errors]
        out.append(
            SourceFigure(
                name,
                len(errors),
                statistics.median(values),
                max(values),
                statistics.median(e.error * 100 for e in errors),
            )
        )
    return PerSource(out)


def fitted_constants(corpus: Corpus) -> list[str]:
    """The constants of the model fitted from corpus rows: one GEMM efficiency per generation measured.

    Everything else (attention and shape efficiencies, overlaps, MoE and TPU terms) comes from a cited
    figure or a measurement, not from these rows. The list is what :func:`fit_efficiencies` returns
    keys for on the whole corpus; a held-out source is always predicted with a refit without it.
    """
    return sorted({efficiency_class(r) for r in corpus.runs})


@dataclass(frozen=True)
class MoEGap:
    """A mixture-of-experts row's held-out error, spread over what the step repeats.

    ``per_layer_s`` is (published - predicted) / (micro-batches x layers of the busiest stage): the time
    per layer and micro-batch (forward and backward) that the model misses, positive where it predicts
    fast. ``per_local_expert_s`` divides it by the experts each GPU holds. A gap that stays the same per
    local expert whatever the tokens per micro-batch is a fixed per-expert cost (host work, launches),
    not a per-token one (GEMMs, memory traffic, all-to-all bytes). A diagnostic, never fitted.
    """

    error: RunError
    micro_batches: int
    layers_per_stage: int
    local_experts: int
    tokens_per_micro_batch: int

    @property
    def per_layer_s(self) -> float:
        """Missed seconds per layer and micro-batch (positive: predicted fast)."""
        gap = self.error.published_s - self.error.predicted_s
        return gap / (self.micro_batches * self.layers_per_stage)

    @property
    def per_local_expert_s(self) -> float:
        """:attr:`per_layer_s` per expert held by one GPU."""
        return self.per_layer_s / self.local_experts


def moe_gaps(errors: list[RunError]) -> list[MoEGap]:
    """The :class:`MoEGap` of every mixture-of-experts row among ``errors`` (dense rows are skipped)."""
    out = []
    for e in errors:
        model = model_spec(e.run)
        if not model.is_moe:
            continue
        run = e.run
        micro_batches = run.global_batch // (run.dp * run.micro_batch)
        out.append(
            MoEGap(
                e,
                micro_batches,
                math.ceil(model.layers / run.pp),
                model.experts // run.ep,
                run.micro_batch * run.seq_len // run.cp,
            )
        )
    return out


# ----- MFU ceilings ----------------------------------------------------------------------------------


def _own_convention(source: Source) -> str:
    """The FLOP convention a source's figures are read with (causal 6N+attn where it prints none)."""
    return source.flop_convention if source.flop_convention not in ("none", "hfu") else "6N+attn-causal"


def source_figure(run: PublishedRun) -> str:
    """The run's published figure as its source prints it (for warnings that quote it)."""
    units = {
        "tflops_per_gpu": "TFLOP/s per GPU",
        "mfu": "MFU",
        "tokens_per_s_per_gpu": "tokens/s per GPU",
        "tokens_per_s": "tokens/s",
        "step_time_s": "s per step",
        "seq_per_s": "sequences/s",
    }
    return f"{run.value:g} {units[run.metric]}"


def mfu_ceilings(corpus: Corpus) -> dict[str, dict[str, object]]:
    """The best published MFU per ``device/precision/band`` (sequence-length band, :func:`seq_band`).

    Each row's MFU is first read with its source's own FLOP convention (``source_mfu``: what the source
    prints, e.g. Llama 3's 380 TFLOP/s per GPU at 131K tokens is 38% of the H100's dense peak), then
    recounted with causal attention (``mfu``: 6N + 6 l h s per token, the products a causal kernel
    performs), the one convention plans are compared in. Counting the full s x s score matrix instead
    (PaLM's 12 l h s) would double the attention term and, at 131K tokens, put that row at 54%.

    Mixture-of-experts runs are left out: their MFU (routing, all-to-alls) says nothing about a dense
    plan's. The planner warns when a plan's predicted MFU, recounted the same way, is above the ceiling of its
    band (:mod:`gpuyard.fabric.published.ceilings` ships these figures so that planning does not read
    the corpus).
    """
    from gpuyard.fabric.published.ceilings import seq_band
    from gpuyard.hardware.catalog import get_spec

    best: dict[str, dict[str, object]] = {}
    for run in corpus.runs:
        precision = "bf16" if run.precision == "fp16" else run.precision
        source = corpus.sources[run.source]
        model = model_spec(run)
        if model.is_moe:  # routing and all-to-alls keep MoE MFU low: no ceiling for dense plans
            continue
        peak = get_spec(run.device).peak_tflops(precision) * 1e12
        step_s = corpus.published[run.id]
        if run.metric == "mfu":
            own = run.value / 100 if run.value > 1 else run.value
        elif run.metric == "tflops_per_gpu":
            own = run.value * 1e12 / peak
        else:
            own = flops_per_step(run, model, _own_convention(source)) / (step_s * run.gpus * peak)
        causal = model.model_flops_per_token(run.seq_len, causal=True) * run.tokens_per_step
        mfu = causal / (step_s * run.gpus * peak)
        key = f"{run.device}/{precision}/{seq_band(run.seq_len)}"
        if key not in best or mfu > float(str(best[key]["mfu"])):
            best[key] = {
                "mfu": round(mfu, 4),
                "source_mfu": round(own, 4),
                "convention": _own_convention(source),
                "figure": source_figure(run),
                "seq_len": run.seq_len,
                "run": run.id,
            }
    return dict(sorted(best.items()))
