"""Typed inputs of each stage kind (a stage's ``with``): one pydantic model per kind, errors in one line.

A pipeline is checked twice. When the spec is parsed, :func:`check_names` refuses an input a kind
does not take and a required one left out (the values may still be ``${stage.key}`` references);
when a stage is about to run, its resolved inputs are validated whole by :func:`stage_inputs`. Either
way the error is one line naming the stage and the input. Stages named by ``module:function`` take
whatever they are given.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuyard.errors import ConfigError

Task = Literal["classification", "regression"]


class StageInputs(BaseModel):
    """What every kind's inputs share: no unknown names, numbers accepted where text is expected."""

    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)


class IngestInputs(StageInputs):
    """``ingest``: a source ingested as a version of dataset ``name``, validated on the way in."""

    source: str = Field(
        description="sklearn:NAME, a file or folder relative to the pipeline, or generate:MOD:FN"
    )
    name: str = Field(description="the dataset the version belongs to")
    label_column: str | None = Field(None, description="the label column (validated against labels)")
    labels: list[Any] | None = Field(None, description="the label values allowed")
    checks: dict[str, Any] | None = Field(None, description="a ValidationSpec mapping")
    inject_bad: int = Field(0, ge=0, description="rows with a bad label added on purpose (the quarantine)")
    generate_kwargs: dict[str, Any] | None = Field(None, description="keyword arguments of generate:")


class TransformInputs(StageInputs):
    """``transform``: a recipe applied to a dataset version."""

    dataset: str = Field(description="the dataset reference")
    recipe: dict[str, Any] | str = Field(
        description="a recipe mapping, or a YAML file relative to the pipeline"
    )
    engine: str | None = Field(None, description="serial or pool (default: by the number of rows)")
    output: str | None = Field(None, description="the name of the new version's dataset")


class _ModelData(StageInputs):
    dataset: str = Field(description="the dataset reference (its split column selects rows)")
    splits: list[str] | None = Field(None, description="the splits to read (default: train and val)")
    spec: dict[str, Any] = Field(description="a model spec (gpuyard.models.spec) without its dataset")


class TuneInputs(_ModelData):
    """``tune``: a hyperparameter search of ``spec`` (which needs a ``search`` section)."""

    executor: str = Field("pool", description="where trials run: pool, subprocess, inline or jobs")


class FitInputs(_ModelData):
    """``fit``: one tracked fit of ``spec``, its params overridden by ``params``."""

    params: dict[str, Any] | None = Field(None, description="params over the spec's")


class EvaluateInputs(StageInputs):
    """``evaluate``: a model (a run or a saved folder) scored on a held-out split, ``require`` gating."""

    dataset: str = Field(description="the dataset reference")
    run: str | None = Field(None, description="a tracked run (its model; the evaluation is recorded on it)")
    model_dir: str | None = Field(None, description="a saved model folder (wins over run's model)")
    task: Task = "classification"
    split: str = Field("test", description="the held-out split")
    metrics: list[str] | None = Field(None, description="metrics to compute (default: the task's)")
    require: dict[str, float] | None = Field(None, description="metric -> bound the model must meet")


class RegisterInputs(StageInputs):
    """``register``: a model (a run or a folder) registered as ``name`` and put up for promotion."""

    name: str = Field(description="the registered model's name")
    dataset: str = Field(description="the dataset reference (its test split decides promotion)")
    run: str | None = Field(None, description="the run the model comes from")
    model_dir: str | None = Field(None, description="a saved model folder (registered instead of the run's)")
    run_dir: str | None = Field(None, description="the training run's folder (lineage)")
    task: Task = "classification"
    metrics: dict[str, Any] | None = Field(None, description="test metrics recorded with the version")
    metric: str | None = Field(None, description="the metric promotion compares")


class TrainInputs(StageInputs):
    """``train``: ``gpuyard train`` (torchrun, DDP) of an image classifier on a dataset version."""

    dataset: str = Field(description="NAME[@VERSION] without #split= (train and val are read)")
    params: dict[str, Any] | None = Field(
        None, description="hidden, activation, lr, weight_decay, batch_size"
    )
    epochs: int | None = Field(None, description="epochs (default: params.epochs, else 10)")
    nproc: int = Field(2, ge=1, description="processes (DDP ranks)")
    seed: int = 0
    classes: int = Field(10, ge=1, description="output classes")
    column: str = Field("image", description="the input column")
    label: str = Field("label", description="the label column")
    warmup_steps: int = Field(10, ge=0, description="learning-rate warm-up")
    experiment: str = Field("default", description="the tracked run's experiment")
    run_name: str = Field("pipeline-train", description="the tracked run's name")


class ServeInputs(StageInputs):
    """``serve``: a registered model deployed, sent a dataset's test split, then a shifted copy."""

    model: str = Field(description="a model reference NAME[:VERSION|@ALIAS]")
    dataset: str = Field(description="the dataset reference (its test split is sent)")


class PlanInputs(StageInputs):
    """``plan``: data-parallel training of a saved model priced on a cluster preset."""

    model_dir: str = Field(description="a saved model folder (its parameter count)")
    cluster: str = Field("dgx-h100", description="a cluster preset or file")
    global_batch: int = Field(65536, ge=1, description="samples per step over all GPUs")
    gpu_counts: list[int] = Field([8, 16, 64, 256], min_length=1, description="GPU counts to price")


class TextIngestInputs(StageInputs):
    """``text-ingest``: a text corpus (documents or chat records) as a version of dataset ``name``."""

    source: str = Field(description="a .txt/.md file or folder, or JSONL/Parquet (relative to the pipeline)")
    name: str = Field(description="the dataset the version belongs to")
    format: Literal["text", "jsonl", "parquet"] | None = Field(None, description="default: from the path")
    text_field: str = Field("text", description="the field holding a document (JSONL/Parquet)")
    messages_field: str | None = Field(
        None, description="the field holding a chat record (role/content list)"
    )
    max_doc_bytes: int = Field(1 << 20, ge=1, description="documents over this size are quarantined")


class TokenizeInputs(StageInputs):
    """``tokenize``: a text version tokenized and packed into fixed-length sequences."""

    dataset: str = Field(description="a text dataset reference")
    tokenizer: str = Field(description="a tokenizer.json or a folder with it (relative to the pipeline)")
    seq_len: int = Field(ge=2, le=1 << 20, description="tokens per packed sequence")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="documents sent to the val split")
    seed: int = 0
    output: str | None = Field(None, description="the token dataset's name (default NAME-tokens)")
    over_length: Literal["split", "truncate", "drop"] | None = Field(
        None, description="a record over seq_len tokens (default: split documents, truncate chat records)"
    )
    loss_on: Literal["assistant", "all"] | None = Field(
        None, description="chat records: loss on assistant turns (the default) or on all tokens"
    )


class Samples(StageInputs):
    """Greedy generations made at each evaluation (default prompts: the start of validation documents)."""

    prompts: list[str] | None = Field(None, max_length=32, description="prompt texts")
    count: int = Field(3, ge=0, le=32, description="default prompts taken from validation documents")
    prompt_tokens: int = Field(16, ge=1, le=4096, description="tokens of a default prompt (at most half)")
    max_new_tokens: int = Field(16, ge=1, le=1024, description="tokens generated per prompt")


class LlmTrainInputs(StageInputs):
    """``llm-train``: ``gpuyard train`` of a Hugging Face causal LM on a token dataset's train split."""

    dataset: str = Field(description="a token dataset NAME[@VERSION] with train and val splits")
    config: str | None = Field(None, description="a config.json: random initialisation")
    weights: str | None = Field(None, description="a registered model NAME:VERSION or a weights folder")
    lora: dict[str, Any] | None = Field(None, description="LoRA settings {r, alpha, dropout, target_modules}")
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    batch_size: int = Field(16, ge=1, description="sequences per rank and step")
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    val_every_steps: int | None = Field(None, ge=1, description="default: twice, halfway and at the end")
    nproc: int = Field(2, ge=1, le=64, description="processes (DDP ranks)")
    threads: int = Field(1, ge=1, le=256, description="intra-op threads per rank (OMP_NUM_THREADS)")
    seed: int = 0
    samples: Samples = Field(
        default_factory=lambda: Samples.model_validate({}), description="generations at each validation"
    )
    experiment: str = Field("llm", description="the tracked run's experiment")
    run_name: str | None = Field(None, description="the tracked run's name (default: the stage's)")


class LlmRegisterInputs(StageInputs):
    """``llm-register``: an exported Hugging Face folder registered (with ``base``: its LoRA adapter)."""

    name: str = Field(description="the registered model's name")
    model_dir: str = Field(description="the exported folder (llm-train's model_dir)")
    base: str | None = Field(None, description="register the folder's LoRA adapter of this model")
    merge: bool = Field(False, description="with base: also register the adapter merged into it")
    run: str | None = Field(None, description="the training run (lineage)")


class LlmEvalInputs(StageInputs):
    """``llm-eval``: perplexity of a language model on a token dataset, with sample generations."""

    model: str = Field(description="a registered language model or a Hugging Face folder")
    dataset: str = Field(description="a token dataset made with the model's tokenizer")
    split: str = Field("val", description="the split (the whole dataset when it has none)")
    batch_size: int = Field(8, ge=1)
    samples: Samples = Field(
        default_factory=lambda: Samples.model_validate({}), description="generations recorded with it"
    )
    threads: int = Field(1, ge=1, le=256, description="intra-op threads")


class LlmPromoteInputs(StageInputs):
    """``llm-promote``: promotion to production gated on perplexity (and no worse than production)."""

    model: str = Field(description="NAME:VERSION of a registered language model")
    dataset: str = Field(description="the token dataset perplexity is measured on")
    split: str = "val"
    max_perplexity: float | None = Field(None, gt=0, description="refuse above this perplexity")
    threads: int = Field(1, ge=1, le=256, description="intra-op threads")


class LlmServeInputs(StageInputs):
    """``llm-serve``: ``gpuyard serve`` of a language model, one streamed chat completion, then stopped."""

    model: str = Field(description="a registered language model (NAME:VERSION or NAME@ALIAS)")
    message: str = Field(description="the user message of the chat completion")
    max_tokens: int = Field(32, ge=1, le=4096)
    stop: list[str] | None = Field(None, max_length=4, description="stop sequences")
    max_batch: int = Field(8, ge=1, le=1024)
    threads: int = Field(1, ge=1, le=256, description="the server's intra-op threads (OMP_NUM_THREADS)")
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="how long the server may take to start")
    engine: Literal["gpuyard", "vllm", "auto"] = Field(
        "gpuyard",
        description="the serving engine (docs/llm.md): gpuyard's own starts in seconds; vLLM takes "
        "minutes on a busy CPU (raise start_timeout_s)",
    )


INPUTS: dict[str, type[StageInputs]] = {
    "ingest": IngestInputs,
    "transform": TransformInputs,
    "tune": TuneInputs,
    "fit": FitInputs,
    "train": TrainInputs,
    "evaluate": EvaluateInputs,
    "register": RegisterInputs,
    "serve": ServeInputs,
    "plan": PlanInputs,
    "text-ingest": TextIngestInputs,
    "tokenize": TokenizeInputs,
    "llm-train": LlmTrainInputs,
    "llm-register": LlmRegisterInputs,
    "llm-eval": LlmEvalInputs,
    "llm-promote": LlmPromoteInputs,
    "llm-serve": LlmServeInputs,
}

M = TypeVar("M", bound=StageInputs)


def check_names(kind: str, inputs: dict[str, Any], stage: str) -> None:
    """Refuse an input that ``kind`` does not take, or a required one left out (values unchecked).

    Raises:
        ValueError: naming the stage and the input (pydantic turns it into a field error).
    """
    model = INPUTS.get(kind)
    if model is None:
        return
    fields = model.model_fields
    unknown = sorted(set(inputs) - set(fields))
    if unknown:
        raise ValueError(
            f"stage {stage!r}: {kind} takes no input {unknown[0]!r} (it takes: {', '.join(fields)})"
        )
    missing = [name for name, f in fields.items() if f.is_required() and name not in inputs]
    if missing:
        raise ValueError(f"stage {stage!r}: input {missing[0]!r} is required (with: {{{missing[0]}: ...}})")


def parse_inputs(model: type[M], inputs: dict[str, Any], stage: str) -> M:
    """``inputs`` validated as ``model``.

    Raises:
        ConfigError: one line naming the stage and the first bad input.
    """
    try:
        return model.model_validate(inputs)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        got = (
            "" if first["type"] in ("missing", "extra_forbidden") else f" (got {_short(first.get('input'))})"
        )
        if first["type"] == "missing":
            raise ConfigError(
                f"stage {stage!r}: input {where!r} is required (with: {{{where}: ...}})"
            ) from exc
        raise ConfigError(f"stage {stage!r}: input {where!r}: {first['msg']}{got}") from exc


def stage_inputs(kind: str, inputs: dict[str, Any], stage: str) -> StageInputs | None:
    """The typed inputs of a stage of ``kind`` (None for a ``module:function`` stage).

    Raises:
        ConfigError: one line naming the stage and the first bad input.
    """
    model = INPUTS.get(kind)
    return None if model is None else parse_inputs(model, inputs, stage)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
