"""The YAML spec of `gpuyard models fit`, `gpuyard cv` and `gpuyard tune`: data, trainer, metric, search."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuyard.errors import ConfigError
from gpuyard.models.datasets import Dataset, SplitSpec
from gpuyard.models.metrics import DEFAULT_METRICS, METRICS, check_direction, check_task
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
    # None: the dataset's split of record when it has one (a recipe's split), else SplitModel()'s cut.
    split: SplitModel | None = None
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
        """The task given, or the metric's (before the data is read: :func:`task_for_data` decides)."""
        return check_task(self.task or METRICS[self.metric].task)

    @property
    def split_or_default(self) -> SplitModel:
        """The split the spec asks for, or the default cut (val 0.2, test 0.2, seed 0)."""
        return self.split or SplitModel()


def _label_words(ds: Dataset) -> str:
    """How the label of ``ds`` reads: ``categorical (integer label, 2 classes)`` or ``continuous (...)``."""
    import numpy as np

    if ds.task == "classification":
        return f"categorical (integer or bool label, {len(np.unique(ds.y))} classes)"
    return "continuous (float label)"


def _estimator_kind(trainer: str, params: dict[str, Any]) -> tuple[str, str, bool] | None:
    """(estimator path, classification/regression, gives probabilities) of a scikit-learn estimator
    the trainer will fit, built with the params it takes."""
    if not trainer.endswith(":train_sklearn") or "estimator" not in params:
        return None
    path = str(params["estimator"])
    module_name, _, cls_name = path.rpartition(".")
    if not module_name.startswith("sklearn."):
        return None  # train_sklearn refuses it in one line itself
    import importlib

    from sklearn.base import is_classifier, is_regressor

    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        valid = cls().get_params()
        est = cls(**{k: v for k, v in params.items() if k in valid})
    except Exception:
        return None
    proba = hasattr(est, "predict_proba")  # SVC: only with probability=True
    if is_classifier(est):
        return path, "classification", proba
    if is_regressor(est):
        return path, "regression", proba
    return None


def task_for_data(spec: ModelSpec, ds: Dataset, params: dict[str, Any] | None = None) -> str:
    """The task of fitting ``spec`` on ``ds``: the label's, checked against everything the spec says.

    The label decides (an integer or bool label is categorical: classification; a float label is
    continuous: regression). A spec that says otherwise is a configuration error, never a silent
    switch: ``task:``, a ``metric`` of the other task (``mse`` on a 0/1 label), or a scikit-learn
    estimator of the other kind (a regressor on a categorical label), in the params or among the
    search choices.

    Raises:
        ConfigError: a contradiction, in one line naming the field, the dataset and the label.
    """
    import numpy as np

    task = ds.task
    words = _label_words(ds)
    what = f"the label of {ds.version} is {words}"
    if spec.task is not None and spec.task != task:
        hint = (
            "; store the label as float to fit a regression"
            if task == "classification"
            else "; declare the label int at ingest (--checks 'columns: {LABEL: {type: int}}') to classify"
        )
        raise ConfigError(f"{spec.name}: task: {spec.task} contradicts the data: {what}{hint}")
    metric = METRICS[spec.metric]
    if metric.task != task:
        fits = ", ".join(DEFAULT_METRICS[task][:4])
        raise ConfigError(
            f"{spec.name}: metric {spec.metric!r} is a {metric.task} metric but {what}: use a {task} "
            f"metric ({fits}, ...)"
        )
    merged = {**spec.params, **(params or {})}
    candidates = [merged]
    if spec.search is not None and "estimator" in spec.search.space:
        choices = spec.search.space["estimator"].choices or []
        candidates += [{**merged, "estimator": c} for c in choices]
    for cand in candidates:
        found = _estimator_kind(spec.trainer, cand)
        if found is not None and found[1] != task:
            kind = "regressor" if found[1] == "regression" else "classifier"
            raise ConfigError(f"{spec.name}: estimator {found[0]} is a {kind} but {what}")
        if found is not None and metric.needs_proba and not found[2]:
            raise ConfigError(
                f"{spec.name}: metric {spec.metric!r} needs class probabilities, and estimator "
                f"{found[0]} gives none with these params (e.g. SVC needs probability: true)"
            )
    if task == "classification" and len(ds.y) and len(np.unique(ds.y)) < 2:
        raise ConfigError(f"{spec.name}: {what}: a classifier needs at least two classes")
    if task == "classification" and spec.trainer.endswith(":train_mlp") and len(ds.y) and ds.y.min() < 0:
        raise ConfigError(
            f"{spec.name}: train_mlp needs class labels 0..K-1, and the label of {ds.version} has "
            f"{int(ds.y.min())}: recode it (a recipe's encode step with method: ordinal) or use train_sklearn"
        )
    return task


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
