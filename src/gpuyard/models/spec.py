"""The YAML spec of `gpuyard models fit`, `gpuyard cv` and `gpuyard tune`: data, trainer, metric, search."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuyard.errors import ConfigError
from gpuyard.models.datasets import SplitSpec
from gpuyard.models.metrics import METRICS, check_direction, check_task
from gpuyard.textfiles import load_yaml


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SearchParam(_Strict):
    """One dimension of the search space."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> SearchParam:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty 'choices' list")
        elif self.low is None or self.high is None or self.low > self.high:
            raise ValueError(f"a {self.type} parameter needs low <= high")
        elif self.log and self.low <= 0:
            raise ValueError("a log-scaled parameter needs low > 0")
        return self


class SearchSpec(_Strict):
    """How to search: sampler, pruner, trial count and how many trials run at once."""

    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Literal["none", "median", "successive_halving"] = "none"
    n_trials: int = Field(default=8, ge=1, le=10_000)
    parallel: int = Field(default=1, ge=1, le=64)
    # Trials that must complete before the median pruner starts stopping others.
    startup_trials: int = Field(default=2, ge=0)
    space: dict[str, SearchParam]

    @model_validator(mode="after")
    def _space(self) -> SearchSpec:
        if not self.space:
            raise ValueError("search.space needs at least one parameter")
        if self.sampler == "grid":
            for name, p in self.space.items():
                if p.type == "float" and p.step is None:
                    raise ValueError(f"grid search needs 'step' (or 'choices') for float parameter {name!r}")
        return self


class CVSpec(_Strict):
    """k-fold cross-validation on the train+validation part (the test split stays out)."""

    folds: int = Field(default=5, ge=2, le=100)
    parallel: int = Field(default=1, ge=1, le=64)


class SplitModel(_Strict):
    """Fractions and seed of the train / validation / test split."""

    val: float = Field(default=0.2, ge=0, lt=1)
    test: float = Field(default=0.2, gt=0, lt=1)
    seed: int = 0
    stratify: bool = True

    def to_spec(self) -> SplitSpec:
        """The library's frozen dataclass."""
        return SplitSpec(val=self.val, test=self.test, seed=self.seed, stratify=self.stratify)


class ModelSpec(_Strict):
    """Everything needed to train, evaluate, cross-validate and tune one kind of model."""

    name: str = Field(min_length=1, max_length=200)
    experiment: str = Field(default="default", min_length=1, max_length=200)
    dataset: str = Field(min_length=1)
    task: Literal["classification", "regression"] | None = None
    trainer: str = "gpuyard.models.builtin:train_mlp"
    params: dict[str, Any] = Field(default_factory=dict)
    metric: str = "accuracy"
    direction: Literal["maximize", "minimize"] | None = None
    seed: int = 0
    split: SplitModel = Field(default_factory=lambda: SplitModel())
    search: SearchSpec | None = None
    cv: CVSpec | None = None

    @model_validator(mode="after")
    def _metric(self) -> ModelSpec:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}: use one of {', '.join(sorted(METRICS))}")
        if self.task is not None and METRICS[self.metric].task != self.task:
            raise ValueError(
                f"metric {self.metric!r} is a {METRICS[self.metric].task} metric; task is {self.task}"
            )
        if self.direction is not None:
            try:
                check_direction(self.direction, self.metric)
            except ConfigError as exc:
                raise ValueError(str(exc)) from exc
        return self

    @property
    def resolved_direction(self) -> str:
        """The direction given, or the metric's own."""
        return self.direction or METRICS[self.metric].direction

    @property
    def resolved_task(self) -> str:
        """The task given, or the metric's."""
        return check_task(self.task or METRICS[self.metric].task)


def parse_spec(doc: Any, source: str = "spec") -> ModelSpec:
    """Validate a spec document.

    Raises:
        ConfigError: naming the field (``search.space.lr.low: ...``) and the source.
    """
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a spec is a mapping of fields, got {type(doc).__name__}")
    try:
        return ModelSpec.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigError(f"{source}: {where}: {first['msg']}") from exc


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a YAML spec file.

    Raises:
        ConfigError: missing file, bad YAML, or an invalid field.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"spec file {p} does not exist")
    return parse_spec(load_yaml(p, "model spec"), str(p))
