"""The YAML training spec (pydantic, so errors name the field) and `module:function` entrypoint loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.textfiles import load_yaml, parse_yaml


class _Strict(BaseModel):
    # Unknown keys are typos far more often than intent: reject them so the message names the field.
    model_config = ConfigDict(extra="forbid", frozen=True)


class EntrypointSpec(_Strict):
    """A `module:function` factory and the keyword arguments it is called with; a plain string
    ``module:function`` is short for ``{entrypoint: module:function}`` (no arguments)."""

    entrypoint: str = Field(description="'package.module:function' returning the object")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the call")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"entrypoint": value} if isinstance(value, str) else value


class DataSpec(_Strict):
    """Where batches come from: a map-style Dataset or a resumable loader (state_dict/load_state_dict)."""

    train: EntrypointSpec | None = Field(
        None, description="required in YAML; the Python API may pass objects"
    )
    val: EntrypointSpec | None = None
    batch_size: int = Field(32, gt=0, description="samples per micro-batch per data-parallel rank")
    global_batch_size: int | None = Field(
        None,
        gt=0,
        description="samples per optimizer step over all data-parallel ranks, instead of batch_size "
        "(each rank takes global_batch_size / (dp x grad_accum)): the sample order and the steps "
        "then do not depend on the world size, so a run can resume at another one",
    )
    shuffle: bool = True
    drop_last: bool = True
    num_workers: int = Field(0, ge=0, description="DataLoader workers for map-style datasets")
    input_key: str = Field("inputs", description="key of the inputs when a batch is a mapping")
    target_key: str = Field("targets", description="key of the targets when a batch is a mapping")

    @model_validator(mode="after")
    def _one_batch_size(self) -> DataSpec:
        if self.global_batch_size is not None and "batch_size" in self.model_fields_set:
            raise ValueError("set data.batch_size (per rank) or data.global_batch_size, not both")
        return self


class OptimizerSpec(_Strict):
    """Optimizer settings; weight decay is decoupled (AdamW) or L2 (SGD)."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)


class ScheduleSpec(_Strict):
    """Learning-rate schedule: constant, linear warm-up then cosine decay, or step decay."""

    kind: Literal["constant", "warmup_cosine", "step"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    step_size: int = Field(1000, gt=0, description="steps between decays (kind=step)")
    gamma: float = Field(0.1, gt=0, description="decay factor (kind=step)")


class EarlyStoppingSpec(_Strict):
    """Stop when the validation metric has not improved for `patience` validations."""

    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = Field(3, gt=0)
    min_delta: float = Field(0.0, ge=0)


class ParallelSpec(_Strict):
    """How ranks form the device mesh: pp x dp x tp == world size (dp=None: whatever is left)."""

    dp: int | None = Field(None, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    data_parallel: Literal["ddp", "fsdp"] = Field("ddp", description="how the dp dimension is applied")
    pp_schedule: Literal["gpipe", "1f1b"] = "gpipe"
    microbatches: int = Field(2, gt=0, description="pipeline micro-batches per batch")


class CheckpointSpec(_Strict):
    """When and how checkpoints are written."""

    every_steps: int = Field(0, ge=0, description="0: only at epoch end and on stop")
    at_epoch_end: bool = True
    keep: int = Field(3, gt=0, description="how many complete checkpoints to keep")
    final: bool = Field(True, description="checkpoint the final step when training completes")
    async_save: bool = False
    resume: bool = Field(True, description="resume from the newest complete checkpoint in run_dir")
    memory_every: int = Field(
        0,
        ge=0,
        description="steps between in-memory snapshots (host memory, replicated on the next rank); 0: off",
    )
    persist_every: int = Field(
        0,
        ge=0,
        description="steps between background writes of the in-memory snapshot to storage "
        "(a multiple of memory_every); 0: never",
    )

    @model_validator(mode="after")
    def _check_memory(self) -> CheckpointSpec:
        if self.persist_every and not self.memory_every:
            raise ValueError("persist_every needs memory_every (it writes the in-memory snapshot)")
        if self.persist_every and self.persist_every % self.memory_every:
            raise ValueError(
                f"persist_every={self.persist_every} must be a multiple of memory_every={self.memory_every}"
            )
        return self


class StragglerSpec(_Strict):
    """Straggler detection (ranks > 1): a rank slower at `min_fraction` of the last `window` steps
    by `slowdown` x the other ranks' median and at least `min_seconds` is named (docs/training.md)."""

    enabled: bool = True
    window: int = Field(20, gt=1, description="steps compared at a time")
    min_fraction: float = Field(0.75, gt=0, le=1, description="share of the window a rank must be slower at")
    slowdown: float = Field(1.2, gt=1, description="slower means this many times the other ranks' median")
    min_seconds: float = Field(0.005, ge=0, description="and at least this much slower, in seconds")


class TrackingSpec(_Strict):
    """Where the run is recorded; `tracking: db` / `tracking: jsonl` is short for `{backend: ...}`."""

    backend: Literal["db", "jsonl"] = Field(
        "db", description="db: a run in the state store (rank 0), plus metrics.jsonl; jsonl: only the file"
    )
    experiment: str | None = Field(None, min_length=1, max_length=200, description="default: the spec's name")
    run_name: str | None = Field(None, min_length=1, max_length=200, description="default: the spec's name")
    dataset: str | None = Field(
        None,
        description="gpuyard dataset 'name[@version]' read; default: data.train.kwargs.dataset if it is one",
    )
    tags: dict[str, str] = Field(default_factory=dict, description="free-form labels on the run")


class TrainSpec(_Strict):
    """A whole training job, as written in SPEC.yaml."""

    name: str = "train"
    run_dir: str | None = Field(None, description="default: ./runs/<name>")
    seed: int = 0
    model: EntrypointSpec | None = Field(
        None, description="required in YAML; the Python API may pass a factory"
    )
    data: DataSpec = Field(default_factory=lambda: DataSpec.model_validate({}))
    loss: str = Field("cross_entropy", description="cross_entropy | mse | l1 | a 'module:function'")
    optimizer: OptimizerSpec = Field(default_factory=lambda: OptimizerSpec.model_validate({}))
    schedule: ScheduleSpec = Field(default_factory=lambda: ScheduleSpec.model_validate({}))
    epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many optimizer steps")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    clip_grad_norm: float | None = Field(None, gt=0)
    val_every_steps: int = Field(0, ge=0, description="0: validate at each epoch end")
    early_stopping: EarlyStoppingSpec | None = None
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 on CUDA, else fp32")
    compile: bool = False
    peak_tflops: float | None = Field(
        None, gt=0, description="per-device peak for MFU; default: the catalog's peak of the detected GPU"
    )
    parallel: ParallelSpec = Field(default_factory=lambda: ParallelSpec.model_validate({}))
    checkpoint: CheckpointSpec = Field(default_factory=lambda: CheckpointSpec.model_validate({}))
    max_restarts: int = Field(3, ge=0, description="torchrun worker restarts after a failure")
    straggler: StragglerSpec = Field(default_factory=lambda: StragglerSpec.model_validate({}))
    log_every_steps: int = Field(1, gt=0)
    callbacks: list[str] = Field(default_factory=list, description="'module:function'(trainer, event)")
    tracking: TrackingSpec = Field(default_factory=lambda: TrackingSpec.model_validate({}))

    @field_validator("tracking", mode="before")
    @classmethod
    def _tracking_shorthand(cls, value: Any) -> Any:
        return {"backend": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_pipeline(self) -> TrainSpec:
        # With global_batch_size the per-rank batch is known only with the world size (not checked here).
        per_rank = self.data.global_batch_size is None
        if per_rank and self.parallel.pp > 1 and self.data.batch_size % self.parallel.microbatches:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} must be a multiple of "
                f"parallel.microbatches={self.parallel.microbatches}"
            )
        return self

    def resolved_run_dir(self) -> Path:
        """The run folder (checkpoints, metrics.jsonl, status.json)."""
        return Path(self.run_dir or Path("runs") / self.name).expanduser().resolve()


def _format_validation(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(spec)"
        parts.append(f"{loc}: {err['msg']}")
    return f"{source}: " + "; ".join(parts)


def parse_spec(doc: Any, source: str = "spec") -> TrainSpec:
    """Validate a mapping as a TrainSpec.

    Raises:
        ConfigError: naming each invalid field (dotted path) and why.
    """
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(doc).__name__}")
    try:
        return TrainSpec.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source)) from None


def load_spec(
    path: str | Path, overrides: dict[str, Any] | None = None, text: str | None = None
) -> TrainSpec:
    """Read SPEC.yaml and validate it; `overrides` replace top-level fields (mappings merge into them).
    With ``text``, that is the file's text (read by the caller) and ``path`` only names it.

    Raises:
        ConfigError: unreadable file, bad YAML, or an invalid field (named).
    """
    path = Path(path)
    try:
        doc = load_yaml(path, "training spec") if text is None else parse_yaml(text, path)
    except NotFoundError as exc:
        raise ConfigError(str(exc)) from None  # as before: a missing spec is a bad argument
    if isinstance(doc, dict) and overrides:
        doc = dict(doc)
        if isinstance(doc.get("tracking"), str):  # so `--experiment X` keeps `tracking: jsonl`
            doc["tracking"] = {"backend": doc["tracking"]}
        for key, value in overrides.items():
            # A mapping merges into the spec's own (a plan's {dp, tp, pp} keeps parallel.pp_schedule).
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = {**doc[key], **value}
            else:
                doc[key] = value
    spec = parse_spec(doc, source=str(path))
    if spec.model is None:
        raise ConfigError(f"{path}: model: Field required (an entrypoint: 'package.module:function')")
    if spec.data.train is None:
        raise ConfigError(f"{path}: data.train: Field required (an entrypoint: 'package.module:function')")
    return spec


def parallel_from_plan(plan: dict[str, Any]) -> dict[str, int]:
    """Pick {dp, tp, pp} out of a planner result (`gpuyard plan --json`), top level or nested.

    Raises:
        ConfigError: when no mapping with integer dp, tp and pp keys is found.
    """
    candidates = [plan] + [plan[k] for k in ("parallel", "plan", "best") if isinstance(plan.get(k), dict)]
    for cand in candidates:
        if all(isinstance(cand.get(k), int) for k in ("dp", "tp", "pp")):
            return {k: int(cand[k]) for k in ("dp", "tp", "pp")}
    raise ConfigError("plan: no mapping with integer 'dp', 'tp' and 'pp' (top level or under 'parallel')")


def load_plan(path: str | Path) -> dict[str, int]:
    """Read a plan JSON file and return its {dp, tp, pp}."""
    try:
        return parallel_from_plan(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the plan ({exc})") from None
