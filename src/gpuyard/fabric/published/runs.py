"""Published measured LLM training runs (runs.yaml): pydantic schema, loader and model resolution."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric.models import PRESETS, ModelSpec, TransformerShape
from gpuyard.fabric.step import ParallelConfig

RUNS_FILE = Path(__file__).with_name("runs.yaml")

SourceKind = Literal["paper", "framework-table", "mlperf", "vendor-page"]
Stack = Literal[
    "megatron-lm",
    "megatron-lm-2021",
    "nemo",
    "torchtitan",
    "deepspeed",
    "llm-foundry",
    "mlperf-nvidia",
    "maxtext",
    "other",
]
Metric = Literal["tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "tokens_per_s", "step_time_s", "seq_per_s"]
# Metrics that give the step time without any FLOP convention.
DIRECT_METRICS = ("tokens_per_s_per_gpu", "tokens_per_s", "step_time_s", "seq_per_s")


class Source(BaseModel):
    """Where a group of runs was published and how it counts FLOPs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    title: str
    kind: SourceKind
    stack: Stack
    flop_convention: str
    url: str | None = None
    regression_guard_pct: float = Field(
        default=25.0,
        gt=0,
        description="A regression guard, not an accuracy goal: the largest |predicted / published - 1| "
        "the shipped presets may show on this source's rows (its worst error today plus a margin; "
        "tests/unit/fabric/test_step_accuracy.py). The accuracy goal is a benchmark figure "
        "(benchmarks/fabric_accuracy.py).",
    )
    notes: str = ""


class ModelShape(TransformerShape):
    """A transformer shape given in the corpus (models: section or inline in a run), with its source."""

    name: str
    config: str = ""  # where the shape comes from (released config file, paper table)

    def at(self, seq_len: int) -> ModelSpec:
        """The step model's ModelSpec for this shape, under its own name, at ``seq_len``."""
        return self.spec(self.name, seq_len)


class PublishedRun(BaseModel):
    """One measured training run: layout, batch and the published figure."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    source: str
    where: str
    device: str
    cluster: str
    network: str
    model: str | ModelShape
    seq_len: int = Field(gt=0)
    gpus: int = Field(gt=0)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    virtual_stages: int = Field(default=1, ge=1)
    micro_batch: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    recompute: Literal["none", "selective", "full"]
    zero: Literal[0, 1, 2, 3]
    sequence_parallel: bool = False
    precision: Literal["bf16", "fp16", "fp8"]
    compiled: bool = Field(default=False, description="torch.compile on (the source says so).")
    tp_overlap: bool | None = Field(
        default=None,
        description="TP communication overlapped with GEMMs (e.g. torchtitan's async TP); None: the "
        "source's stack default (gpuyard.fabric.stacks).",
    )
    attention: Literal["unfused", "fa1", "fa2", "fa3", "cudnn"] | None = Field(
        default=None,
        description="Attention kernel family the source documents for this row (e.g. FlashAttention 1 in a "
        "table measured before FlashAttention 2 existed); None: the stack's (gpuyard.fabric.stacks).",
    )
    memory_bw_GBps: float | None = Field(
        default=None,
        gt=0,
        description="Memory bandwidth the source states for its GPUs where they differ from the catalog "
        "device (e.g. torchtitan's 96 GB HBM2e H100 at 2.4 TB/s); None: the catalog's.",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] | None = Field(
        default=None,
        description="float8 scaling recipe of an fp8 row where the source names it (torchao's tensorwise or "
        "rowwise); None: tensorwise, the stacks' default (gpuyard.fabric.stacks.Stack.fp8_recipe).",
    )
    moe_dispatcher: Literal["alltoall", "hybridep"] | None = Field(
        default=None,
        description="MoE token dispatcher backend where the source's recipe names it (Megatron-Core's flex "
        "dispatcher with HybridEP); None: the stack's (gpuyard.fabric.stacks.Stack.moe_dispatcher).",
    )
    selective: Literal["op", "every-2nd-layer", "dots"] | None = Field(
        default=None,
        description="What recompute='selective' means in a row whose source names it: 'op' (torchtitan's "
        "per-op policy), 'every-2nd-layer' (torchtitan's selective_ac_option '2', \"selective layer\": "
        "every other block fully checkpointed) or 'dots' (MaxText's remat_policy 'minimal', "
        "checkpoint_dots_with_no_batch_dims); None: the stack's (gpuyard.fabric.stacks.Stack.selective).",
    )
    pp_async: bool | None = Field(
        default=None,
        description="Whether the source's pipeline posts its sends and receives asynchronously, overlapping "
        "compute, where the source says so (Llama 3: section 3.3.2); None: the stack's "
        "(gpuyard.fabric.stacks.Stack.pp_async).",
    )
    power_limit_w: float | None = Field(
        default=None,
        gt=0,
        description="Power limit the source states its GPUs ran at where it is below the device's rated "
        "power (torchtitan's Grand Teton H100s: 500 W of 700 W); such rows get their own fitted GEMM "
        "efficiency (gpuyard.fabric.accuracy.efficiency_class). None: the device's rated power.",
    )
    regression_guard_pct: float | None = Field(
        default=None,
        gt=0,
        description="This row's regression guard where it differs from its source's (rows of a kind the "
        "model misses by more than the rest of the source, e.g. the first MoE rows); None: the source's.",
    )
    metric: Metric
    value: float = Field(gt=0)
    notes: str = ""

    @property
    def model_name(self) -> str:
        """The preset or shape name of the run's model."""
        return self.model if isinstance(self.model, str) else self.model.name

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step (global batch x sequence length)."""
        return self.global_batch * self.seq_len

    def parallel_config(self) -> ParallelConfig:
        """The run's layout as the step model's ParallelConfig."""
        return ParallelConfig(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            micro_batch=self.micro_batch,
            virtual_stages=self.virtual_stages,
            recompute=self.recompute,
            zero=self.zero,
            sequence_parallel=self.sequence_parallel,
            ep=self.ep,
            precision="bf16" if self.precision == "fp16" else self.precision,
            compiled=self.compiled,
            tp_overlap=self.tp_overlap,
        )

    def direct_step_time_s(self) -> float | None:
        """Step time implied by a directly measured metric, or None for TFLOP/s and MFU figures.

        Returns:
            Seconds per optimizer step for tokens/s, tokens/s/GPU, sequences/s and step-time rows;
            None where the figure needs the source's FLOP convention to convert.
        """
        if self.metric == "step_time_s":
            return self.value
        if self.metric == "tokens_per_s":
            return self.tokens_per_step / self.value
        if self.metric == "tokens_per_s_per_gpu":
            return self.tokens_per_step / (self.value * self.gpus)
        if self.metric == "seq_per_s":
            return self.global_batch / self.value
        return None


class _Corpus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: dict[str, Source]
    models: dict[str, ModelShape] = Field(default_factory=dict)
    runs: list[PublishedRun]


@lru_cache(maxsize=4)
def _load(path: Path) -> _Corpus:
    try:
        raw = yaml.safe_load(path.read_text())
        return _Corpus.model_validate(raw)
    except (OSError, yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"cannot read published runs {path}: {exc}") from None


def load_sources(path: Path = RUNS_FILE) -> dict[str, Source]:
    """Sources of the published runs, by short key.

    Args:
        path: the corpus file; the packaged runs.yaml by default.

    Raises:
        ConfigError: the file is unreadable or a field is invalid.
    """
    return dict(_load(path).sources)


def load_models(path: Path = RUNS_FILE) -> dict[str, ModelShape]:
    """Named model shapes the corpus defines for models that are not gpuyard presets.

    Args:
        path: the corpus file; the packaged runs.yaml by default.

    Raises:
        ConfigError: the file is unreadable or a field is invalid.
    """
    return dict(_load(path).models)


def load_runs(path: Path = RUNS_FILE) -> list[PublishedRun]:
    """Every published run, in file order.

    Args:
        path: the corpus file; the packaged runs.yaml by default.

    Raises:
        ConfigError: the file is unreadable or a field is invalid.
    """
    return list(_load(path).runs)


def model_spec(run: PublishedRun, path: Path = RUNS_FILE) -> ModelSpec:
    """The ModelSpec of a run's model at the run's sequence length.

    A string names a preset of ``gpuyard.fabric.models.PRESETS`` or a shape of the corpus's
    ``models:`` section; a mapping is an inline shape.

    Args:
        run: a run from :func:`load_runs`.
        path: the corpus file whose ``models:`` section resolves named shapes.

    Raises:
        NotFoundError: the name is neither a preset nor a corpus shape.
    """
    if isinstance(run.model, ModelShape):
        return run.model.at(run.seq_len)
    if run.model in PRESETS:
        return replace(PRESETS[run.model], seq_len=run.seq_len)
    shapes = load_models(path)
    if run.model in shapes:
        return shapes[run.model].at(run.seq_len)
    raise NotFoundError(f"run {run.id}: unknown model {run.model!r} (not a preset nor in the corpus models)")
