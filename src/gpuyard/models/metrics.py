"""Task metrics by name, all computed by scikit-learn, each with the direction that counts as better."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError

TASKS = ("classification", "regression")
DIRECTIONS = ("maximize", "minimize")


@dataclass(frozen=True)
class Metric:
    """A named scalar metric.

    Attributes:
        name: what users write (``f1_macro``, ``mse``...).
        task: classification or regression.
        direction: maximize or minimize (what "better" means in selection and promotion).
        needs_proba: computed from class probabilities (ROC-AUC) rather than labels.
        fn: ``fn(y_true, y_pred_or_proba) -> float``, a thin call into sklearn.metrics.
    """

    name: str
    task: str
    direction: str
    needs_proba: bool
    fn: Callable[[Any, Any], float]


def _sk(name: str, **kwargs: Any) -> Callable[[Any, Any], float]:
    def call(y_true: Any, y_pred: Any) -> float:
        import sklearn.metrics as skm

        return float(getattr(skm, name)(y_true, y_pred, **kwargs))

    return call


def _roc_auc(y_true: Any, proba: Any) -> float:
    from sklearn.metrics import roc_auc_score

    proba = np.asarray(proba)
    if proba.ndim == 2 and proba.shape[1] == 2:  # binary: the positive class's probability
        return float(roc_auc_score(y_true, proba[:, 1]))
    if proba.ndim == 1:
        return float(roc_auc_score(y_true, proba))
    return float(
        roc_auc_score(y_true, proba, multi_class="ovr", average="macro", labels=np.arange(proba.shape[1]))
    )


_C, _R, _MAX, _MIN = "classification", "regression", "maximize", "minimize"
_ZD = {"zero_division": 0}
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("accuracy", _C, _MAX, False, _sk("accuracy_score")),
        Metric("balanced_accuracy", _C, _MAX, False, _sk("balanced_accuracy_score")),
        Metric("precision_macro", _C, _MAX, False, _sk("precision_score", average="macro", **_ZD)),
        Metric("precision_weighted", _C, _MAX, False, _sk("precision_score", average="weighted", **_ZD)),
        Metric("recall_macro", _C, _MAX, False, _sk("recall_score", average="macro", **_ZD)),
        Metric("recall_weighted", _C, _MAX, False, _sk("recall_score", average="weighted", **_ZD)),
        Metric("f1_macro", _C, _MAX, False, _sk("f1_score", average="macro", **_ZD)),
        Metric("f1_weighted", _C, _MAX, False, _sk("f1_score", average="weighted", **_ZD)),
        Metric("roc_auc", _C, _MAX, True, _roc_auc),
        Metric("log_loss", _C, _MIN, True, _sk("log_loss")),
        Metric("mse", _R, _MIN, False, _sk("mean_squared_error")),
        Metric("rmse", _R, _MIN, False, _sk("root_mean_squared_error")),
        Metric("mae", _R, _MIN, False, _sk("mean_absolute_error")),
        Metric("r2", _R, _MAX, False, _sk("r2_score")),
    )
}

DEFAULT_METRICS = {
    "classification": (
        "accuracy",
        "precision_macro",
        "precision_weighted",
        "recall_macro",
        "recall_weighted",
        "f1_macro",
        "f1_weighted",
        "roc_auc",
    ),
    "regression": ("mse", "rmse", "mae", "r2"),
}


def check_task(task: str) -> str:
    """Return ``task`` if known, else raise ConfigError listing the tasks."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    return task


def get_metric(name: str, task: str | None = None) -> Metric:
    """The metric called ``name`` (for ``task`` when given).

    Raises:
        ConfigError: unknown name, or a metric of the other task (e.g. ``mse`` for a classifier).
    """
    metric = METRICS.get(name)
    if metric is None:
        raise ConfigError(f"unknown metric {name!r}: use one of {', '.join(sorted(METRICS))}")
    if task is not None and metric.task != check_task(task):
        raise ConfigError(f"metric {name!r} is a {metric.task} metric, but the task is {task}")
    return metric


def check_direction(direction: str, metric: str | None = None) -> str:
    """Return ``direction`` (maximize/minimize); with ``metric``, it must agree with the metric's own.

    Raises:
        ConfigError: unknown direction, or e.g. maximizing ``mse``.
    """
    if direction not in DIRECTIONS:
        raise ConfigError(f"unknown direction {direction!r}: use maximize or minimize")
    if metric is not None and metric in METRICS and METRICS[metric].direction != direction:
        raise ConfigError(f"metric {metric!r} is better when {METRICS[metric].direction}d, not {direction}d")
    return direction


def is_better(candidate: float, incumbent: float, direction: str) -> bool:
    """True when ``candidate`` is strictly better than ``incumbent`` in ``direction``."""
    check_direction(direction)
    return candidate > incumbent if direction == "maximize" else candidate < incumbent


def compute(name: str, y_true: Any, y_pred: Any, proba: Any | None = None) -> float:
    """Compute metric ``name``; ROC-AUC and log-loss need ``proba``.

    Raises:
        ConfigError: unknown metric, or probabilities needed but not given.
    """
    metric = get_metric(name)
    if metric.needs_proba:
        if proba is None:
            raise ConfigError(f"metric {name!r} needs class probabilities, and the model gives none")
        return metric.fn(y_true, proba)
    return metric.fn(y_true, y_pred)
