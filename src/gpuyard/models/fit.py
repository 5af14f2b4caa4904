"""Train one model from a spec as a tracked run: fit, evaluate validation and test apart, store the model."""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.models.builtin import Pruned, TrainContext
from gpuyard.models.datasets import (
    Dataset,
    Splits,
    load_dataset,
    pin_dataset,
    split_counts,
    split_dataset,
    split_of_record,
    train_folds,
)
from gpuyard.models.evaluate import Evaluation, evaluate, log_evaluation
from gpuyard.models.features import feature_usage
from gpuyard.models.flavors import as_predictor, save_model
from gpuyard.models.signature import infer_signature
from gpuyard.models.spec import ModelSpec, task_for_data
from gpuyard.refs import import_ref
from gpuyard.states import RunStatus
from gpuyard.tracking.store import DbTracker, start_run


@dataclass(frozen=True)
class FitResult:
    """A finished fit: its run, its metrics per split, and the columns it trained on.

    ``features`` is :meth:`~gpuyard.models.features.FeatureUsage.to_json`: the feature columns used
    and the columns left out, each with the reason.
    """

    run_id: str
    status: RunStatus
    evaluations: dict[str, dict[str, float]] = field(default_factory=dict)
    features: dict[str, Any] = field(default_factory=dict)

    def score(self, split: str, metric: str) -> float | None:
        """The value of ``metric`` on ``split``, when evaluated."""
        return self.evaluations.get(split, {}).get(metric)


@functools.lru_cache(maxsize=8)
def _cached(ref: str, stamp: tuple[int, int] | None) -> Dataset:
    return load_dataset(ref)


def cached_dataset(ref: str) -> Dataset:
    """Load a dataset once per process (trials and folds of one search share it).

    A gpuyard dataset reference is pinned first (``NAME``, ``NAME@latest`` and version prefixes
    resolve to the version id, ``#split=`` kept), and the cache is keyed on the pinned reference: a
    version never changes, and a new version ingested later in the same process is a new key. A
    file-backed reference is keyed by the file's size and modification time too.
    """
    if ref.startswith("npz:"):
        path = Path(ref[4:])
        st = path.stat() if path.is_file() else None
        return _cached(ref, (st.st_mtime_ns, st.st_size) if st else None)
    return _cached(pin_dataset(ref), None)


def pinned_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its dataset pinned (see :func:`~gpuyard.models.datasets.pin_dataset`).

    A fit, search or cross-validation pins once at its start, so every trial and fold (in whatever
    process) reads the same version and the run's lineage names it, however new versions arrive.
    """
    pinned = pin_dataset(spec.dataset)
    return spec if pinned == spec.dataset else spec.model_copy(update={"dataset": pinned})


def split_note(spec: ModelSpec, ds: Dataset) -> str | None:
    """The one-line warning for a spec that asks for its own split of a dataset with a split of record."""
    if spec.split is None or not ds.has_split_of_record:
        return None
    sp = spec.split
    counts = ", ".join(f"{k}={v}" for k, v in split_counts(ds).items())
    return (
        f"spec split (val={sp.val}, test={sp.test}, seed={sp.seed}) ignored: {ds.version} has a split of "
        f"record from its recipe ({counts}) whose train rows fitted its statistics; re-splitting would "
        f"leak test rows into training and those statistics, so the split of record is used"
    )


def split_tag(spec: ModelSpec, ds: Dataset) -> dict[str, Any]:
    """The run tag ``split``: the split of record (``of_record`` and row counts) or the spec's cut."""
    if ds.has_split_of_record:
        return {"of_record": ds.version, "rows": split_counts(ds)}
    return spec.split_or_default.model_dump()


def spec_splits(spec: ModelSpec) -> tuple[Dataset, Splits]:
    """The spec's dataset and its train / validation / test split.

    A gpuyard version with a split column (a recipe's split step) is used as split there (see
    :func:`~gpuyard.models.datasets.split_of_record`); any other dataset is cut by the spec's ``split``.
    """
    ds = cached_dataset(spec.dataset)
    if ds.has_split_of_record:
        return ds, split_of_record(ds, spec.split_or_default.to_spec())
    return ds, split_dataset(ds, spec.split_or_default.to_spec())


def fold_splits(spec: ModelSpec, fold: int, folds: int) -> tuple[Dataset, Splits]:
    """Fold ``fold`` of ``folds``; the test split never enters cross-validation.

    With a split of record the folds are cut from its ``train`` rows only (its validation and test
    rows are in no fold); otherwise from the train+validation part of the spec's split.
    """
    from sklearn.model_selection import KFold, StratifiedKFold

    split = spec.split_or_default
    ds = cached_dataset(spec.dataset)
    classify = ds.task == "classification"
    if ds.has_split_of_record:
        train_idx, val_idx = train_folds(ds, folds, split.seed, split.stratify)[fold]
        empty_x, empty_y = ds.X[:0], ds.y[:0]
        return ds, Splits(ds.X[train_idx], ds.y[train_idx], ds.X[val_idx], ds.y[val_idx], empty_x, empty_y)
    sp = split_dataset(ds, split.to_spec())
    X = np.concatenate([sp.X_train, sp.X_val])
    y = np.concatenate([sp.y_train, sp.y_val])
    kf = (StratifiedKFold if classify and split.stratify else KFold)(
        n_splits=folds, shuffle=True, random_state=split.seed
    )
    train_idx, val_idx = list(kf.split(X, y))[fold]
    empty_x, empty_y = X[:0], y[:0]
    return ds, Splits(X[train_idx], y[train_idx], X[val_idx], y[val_idx], empty_x, empty_y)


def log_model(tracker: DbTracker, model: Any, task: str, signature: dict[str, Any]) -> dict[str, Any]:
    """Store the model's flavor files, config and signature as the run's ``model/`` artifacts."""
    with tempfile.TemporaryDirectory(prefix="gpuyard-model-") as tmp:
        flavor, config = save_model(model, tmp, task)
        (Path(tmp) / "signature.json").write_text(json.dumps(signature))
        for path in sorted(Path(tmp).iterdir()):
            tracker.log_artifact(f"model/{path.name}", path)
    tracker.set_tags({"model_flavor": flavor})
    return config


def fit(
    spec: ModelSpec,
    params: dict[str, Any] | None = None,
    *,
    kind: str = "train",
    parent_id: str | None = None,
    name: str | None = None,
    fold: tuple[int, int] | None = None,
    evaluate_test: bool = True,
    keep_model: bool = True,
    reporter: Any = None,
) -> tuple[FitResult, Any]:
    """Train ``spec.trainer`` with ``spec.params`` updated by ``params``, as one tracked run.

    The feature columns used, and any column left out with the reason, come back in the result's
    ``features``, are logged as warnings, and are recorded on the run (tags ``features`` and
    ``dropped_features``): see :mod:`gpuyard.models.features`.

    Args:
        spec: the model spec.
        params: overrides of ``spec.params`` (a trial's sampled values, a tuned best).
        kind: run kind (train, trial, fold, retrain).
        parent_id: the search or cross-validation run this belongs to.
        name: run name (default: the spec's name).
        fold: ``(index, count)`` to train on one cross-validation fold instead of the fixed split.
        evaluate_test: also evaluate on the held-out test split (never during a search).
        keep_model: store the model as the run's artifact.
        reporter: ``(step, value) -> None`` that may raise :class:`Pruned` (search pruning).

    Returns:
        The result and the trained model (None when the trial was pruned).
    """
    spec = pinned_spec(spec)  # lineage (dataset_ref, dataset version) names the version read, never @latest
    merged = {**spec.params, **(params or {})}
    ds, data = fold_splits(spec, *fold) if fold else spec_splits(spec)
    task = task_for_data(spec, ds, params)
    usage = feature_usage(spec.dataset, ds).with_notes(split_note(spec, ds))
    tags: dict[str, Any] = {
        "trainer": spec.trainer,
        "metric": spec.metric,
        "direction": spec.resolved_direction,
        **usage.run_tags(),
    }
    if fold:
        tags["fold"] = f"{fold[0]}/{fold[1]}"
    tracker = start_run(
        name or spec.name,
        experiment=spec.experiment,
        kind=kind,
        params={**merged, "trainer": spec.trainer},
        tags=tags | {"split": split_tag(spec, ds), "dataset_ref": spec.dataset, "task": task},
        dataset_version=ds.version,
        parent_id=parent_id,
        system_interval_s=None if kind in ("trial", "fold") else 10.0,
    )
    ctx = TrainContext(
        task=task, metric=spec.metric, seed=spec.seed, reporter=reporter, log=tracker.log_metrics
    )
    try:
        model = import_ref(spec.trainer, "trainer")(merged, data, ctx)
        evals: dict[str, Evaluation] = {}
        if len(data.X_val):
            evals["validation"] = evaluate(model, data.X_val, data.y_val, task, "validation")
        if evaluate_test and len(data.X_test):
            evals["test"] = evaluate(model, data.X_test, data.y_test, task, "test")
        for ev in evals.values():
            log_evaluation(tracker, ev, ds.version, step=int(merged.get("epochs", 1)))
        if keep_model:
            y_pred = as_predictor(model, task).predict(data.X_train[:256])
            sig = infer_signature(data.X_train, y_pred, task, ds.feature_names)
            log_model(tracker, model, task, sig)
    except Pruned:
        tracker.finish(RunStatus.PRUNED)
        return FitResult(tracker.run_id, RunStatus.PRUNED, features=usage.to_json()), None
    except BaseException as exc:
        tracker.finish(RunStatus.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    tracker.finish(RunStatus.FINISHED)
    metrics = {k: v.metrics for k, v in evals.items()}
    return FitResult(tracker.run_id, RunStatus.FINISHED, metrics, usage.to_json()), model


def load_run_model(run_ref: str) -> Any:
    """The model a run stored (its ``model/`` artifacts), loaded with its flavor.

    Raises:
        NotFoundError: the run stored no model.
    """
    from sqlalchemy import select

    from gpuyard.errors import NotFoundError
    from gpuyard.models.flavors import load_model
    from gpuyard.models.runs import resolve_run_id
    from gpuyard.store import get_artifacts, get_store
    from gpuyard.store.tables.models import RunArtifactRow

    run_id = resolve_run_id(run_ref)
    with get_store().read() as s:
        arts = list(s.scalars(select(RunArtifactRow).where(RunArtifactRow.run_id == run_id)))
    arts = [a for a in arts if a.name.startswith("model/")]
    if not arts:
        raise NotFoundError(f"run {run_id[:8]} stored no model")
    with tempfile.TemporaryDirectory(prefix="gpuyard-run-model-") as tmp:
        for a in arts:
            get_artifacts().get_file(a.key, Path(tmp) / a.name.split("/", 1)[1], sha256=a.sha256)
        model, _ = load_model(tmp)
    return model
