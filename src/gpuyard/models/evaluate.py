"""Evaluate a model on one split with scikit-learn metrics, and record the result per split in the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.models.flavors import Predictor, as_predictor
from gpuyard.models.metrics import DEFAULT_METRICS, check_task, compute, get_metric
from gpuyard.store import get_store
from gpuyard.store.db import Store
from gpuyard.store.tables.models import EvaluationRow

SPLITS = ("validation", "test", "holdout", "train", "cv")


@dataclass(frozen=True)
class Evaluation:
    """Metrics of one model on one split.

    Attributes:
        split: validation, test, holdout, train or cv (validation and test are never mixed).
        task: classification or regression.
        n_samples: rows evaluated.
        metrics: ``{name: value}``.
        details: the confusion matrix and class labels (classification), or nothing.
    """

    split: str
    task: str
    n_samples: int
    metrics: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)


def evaluate(
    model: Any,
    X: np.ndarray,
    y: np.ndarray,
    task: str,
    split: str,
    metrics: list[str] | tuple[str, ...] | None = None,
) -> Evaluation:
    """Compute ``metrics`` (default: every standard metric of the task) of ``model`` on ``(X, y)``.

    Args:
        model: a Predictor, a torch module or a scikit-learn estimator.
        X: features. y: true labels or values.
        task: classification or regression.
        split: which split this is (recorded; see :data:`SPLITS`).
        metrics: metric names (:mod:`gpuyard.models.metrics`).

    Raises:
        ConfigError: unknown split, task or metric; a metric of the other task; an empty split.
    """
    check_task(task)
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    if len(X) == 0 or len(X) != len(y):
        raise ConfigError(
            f"{split} split has {len(X)} rows of features and {len(y)} targets; need equal, non-zero"
        )
    names = list(metrics or DEFAULT_METRICS[task])
    for name in names:
        get_metric(name, task)
    predictor: Predictor = as_predictor(model, task)
    y_pred = predictor.predict(X)
    proba = predictor.predict_proba(X) if any(get_metric(n).needs_proba for n in names) else None
    values: dict[str, float] = {}
    for name in names:
        if get_metric(name).needs_proba and proba is None:
            continue  # e.g. ROC-AUC of a model without probabilities: left out, not made up
        if name == "roc_auc" and len(np.unique(y)) < 2:
            continue  # undefined with one class present
        values[name] = compute(name, y, y_pred, proba)
    details: dict[str, Any] = {}
    if task == "classification":
        from sklearn.metrics import confusion_matrix

        labels = np.unique(np.concatenate([np.asarray(y), np.asarray(y_pred)]))
        details = {
            "labels": labels.tolist(),
            "confusion_matrix": confusion_matrix(y, y_pred, labels=labels).tolist(),
        }
    return Evaluation(split=split, task=task, n_samples=len(X), metrics=values, details=details)


def record_evaluation(
    ev: Evaluation,
    *,
    run_id: str | None = None,
    model_name: str | None = None,
    model_version: int | None = None,
    dataset_version: str | None = None,
    store: Store | None = None,
) -> int:
    """Store ``ev`` against a run and/or a model version; returns the evaluation's id.

    Raises:
        ConfigError: neither a run nor a model version given.
    """
    if run_id is None and model_name is None:
        raise ConfigError("an evaluation belongs to a run or a model version; give one")
    store = store or get_store()
    with store.session() as s:
        row = EvaluationRow(
            run_id=run_id,
            model_name=model_name,
            model_version=model_version,
            split=ev.split,
            task=ev.task,
            dataset_version=dataset_version,
            n_samples=ev.n_samples,
            metrics=ev.metrics,
            details=ev.details,
        )
        s.add(row)
        s.flush()
        return int(row.id)


def log_evaluation(tracker: Any, ev: Evaluation, dataset_version: str | None = None, step: int = 0) -> None:
    """Record ``ev`` for the tracker's run, and its metrics as ``<split>/<name>`` points, apart per split."""
    record_evaluation(ev, run_id=tracker.run_id, dataset_version=dataset_version, store=tracker.store)
    tracker.log_metrics(step, {f"{ev.split}/{k}": v for k, v in ev.metrics.items()})
