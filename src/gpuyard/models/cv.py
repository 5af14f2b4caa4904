"""k-fold cross-validation: each fold a task (a job) on one dataset version, then mean and std per metric."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.models.evaluate import Evaluation, record_evaluation
from gpuyard.models.features import feature_usage
from gpuyard.models.spec import ModelSpec, parse_spec
from gpuyard.scheduler.executors.tasks import Task, TaskExecutor, get_executor
from gpuyard.states import RunStatus
from gpuyard.tracking.store import start_run


@dataclass(frozen=True)
class CVResult:
    """The cross-validation run, its fold runs, and ``{metric: (mean, std)}`` over folds."""

    run_id: str
    fold_runs: list[str]
    summary: dict[str, tuple[float, float]]
    per_fold: dict[str, list[float]]
    dataset_version: str
    features: dict[str, Any] = field(default_factory=dict)


def run_fold(
    spec: dict[str, Any], params: dict[str, Any], fold: int, folds: int, parent_id: str
) -> dict[str, Any]:
    """Train and evaluate one fold as a tracked run (the body of one fold job)."""
    from gpuyard.models.fit import fit

    model_spec = parse_spec(spec, "cv fold spec")
    result, _ = fit(
        model_spec,
        params,
        kind="fold",
        parent_id=parent_id,
        name=f"{model_spec.name}-fold{fold}",
        fold=(fold, folds),
        evaluate_test=False,
        keep_model=False,
    )
    return {"run_id": result.run_id, "metrics": result.evaluations.get("validation", {})}


def cross_validate(
    spec: ModelSpec,
    params: dict[str, Any] | None = None,
    *,
    folds: int | None = None,
    parallel: int | None = None,
    executor: TaskExecutor | None = None,
    executor_name: str = "pool",
) -> CVResult:
    """Run k-fold cross-validation of ``spec`` (with ``params`` overriding ``spec.params``).

    The folds cover train+validation of the spec's split, or only the train rows of a dataset's split
    of record (:func:`~gpuyard.models.fit.fold_splits`); test rows are never seen. Fold runs
    are children of one ``cv`` run, which records ``cv/<metric>_mean`` and ``cv/<metric>_std``
    (population std over folds, as scikit-learn's examples report it) and a ``cv`` evaluation.

    Raises:
        ConfigError: fewer than 2 folds. TaskFailed: a fold failed (the cv run is marked failed).
    """
    from gpuyard.models.fit import cached_dataset, pinned_spec, spec_splits, split_note, split_tag
    from gpuyard.models.spec import task_for_data

    spec = pinned_spec(spec)  # every fold reads this one version, whatever is ingested meanwhile
    k = folds or (spec.cv.folds if spec.cv else 5)
    width = parallel or (spec.cv.parallel if spec.cv else 1)
    if k < 2:
        raise ConfigError(f"cross-validation needs at least 2 folds, got {k}")
    params = params or {}
    ds = cached_dataset(spec.dataset)
    task = task_for_data(spec, ds, params)  # a contradiction stops here, before any fold starts
    usage = feature_usage(spec.dataset, ds).with_notes(split_note(spec, ds))
    tags: dict[str, Any] = {
        "split": split_tag(spec, ds),
        "metric": spec.metric,
        "direction": spec.resolved_direction,
        "trainer": spec.trainer,
        **usage.run_tags(),
    }
    tracker = start_run(
        f"{spec.name}-cv",
        experiment=spec.experiment,
        kind="cv",
        params={**spec.params, **params, "folds": k},
        tags=tags,
        dataset_version=ds.version,
    )
    own = executor is None
    ex = executor or get_executor(executor_name, min(width, k))
    try:
        doc = spec.model_dump(mode="json")
        futures = [
            ex.submit(
                Task(
                    "gpuyard.models.cv:run_fold",
                    dict(spec=doc, params=params, fold=i, folds=k, parent_id=tracker.run_id),
                    name=f"fold {i}",
                )
            )
            for i in range(k)
        ]
        results = [f.result() for f in futures]
    except BaseException as exc:
        tracker.finish(RunStatus.FAILED, error=str(exc)[:2000])
        raise
    finally:
        if own:
            ex.shutdown()
    names = sorted(set.intersection(*(set(r["metrics"]) for r in results)))
    per_fold = {m: [float(r["metrics"][m]) for r in results] for m in names}
    summary = {m: (float(np.mean(v)), float(np.std(v))) for m, v in per_fold.items()}
    for i, r in enumerate(results):
        tracker.log_metrics(i, {f"fold/{m}": r["metrics"][m] for m in names})
    flat = {f"{m}_mean": mu for m, (mu, _) in summary.items()} | {
        f"{m}_std": sd for m, (_, sd) in summary.items()
    }
    tracker.log_metrics(k, {f"cv/{key}": v for key, v in flat.items()})
    _, sp = spec_splits(spec)
    # Rows the folds cover between them: the split of record's train rows, else train+validation.
    n = len(sp.X_train) + (0 if ds.has_split_of_record else len(sp.X_val))
    ev = Evaluation(split="cv", task=task, n_samples=n, metrics=flat, details={"per_fold": per_fold})
    record_evaluation(ev, run_id=tracker.run_id, dataset_version=ds.version)
    tracker.finish(RunStatus.FINISHED)
    fold_runs = [r["run_id"] for r in results]
    return CVResult(tracker.run_id, fold_runs, summary, per_fold, ds.version, usage.to_json())
