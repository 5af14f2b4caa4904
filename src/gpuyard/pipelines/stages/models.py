"""Model stages: search (Optuna, trials in parallel), fit, evaluate on the held-out split, register + promote.

Data comes from a dataset version with a ``split`` column, named by a split-selecting reference
(``NAME@VERSION#split=train,val``, see :mod:`gpuyard.data.arrays`) with the version resolved: search and
fit see only the ``train`` and ``val`` rows (model management splits them again for selection), the
``test`` rows are read only by :func:`evaluate_stage` and promotion. Runs, evaluations and registered
models record those references, so their lineage names the dataset version and the rows they saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.data.arrays import load_arrays, pin, with_splits
from gpuyard.errors import ConfigError
from gpuyard.pipelines.inputs import (
    EvaluateInputs,
    FitInputs,
    RegisterInputs,
    TuneInputs,
    parse_inputs,
)
from gpuyard.refs import DatasetRef


def _selection(ref: str, splits: list[str] | None, default: list[str]) -> str:
    """``ref`` with the version resolved, selecting ``splits`` (or its own, or ``default``)."""
    if splits:
        return pin(with_splits(ref, splits))
    return pin(ref if DatasetRef.has_selection(ref) else with_splits(ref, default))


def _model_spec(inputs: TuneInputs | FitInputs, stage: str) -> Any:
    from gpuyard.models.spec import parse_spec

    doc = dict(inputs.spec)
    doc["dataset"] = _selection(inputs.dataset, inputs.splits, ["train", "val"])
    return parse_spec(doc, f"stage {stage}: spec")


def tune_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameter search with model management's Optuna search; outputs the best params and run."""
    from gpuyard.models.tune import tune

    i = parse_inputs(TuneInputs, inputs, ctx["stage"])
    spec = _model_spec(i, ctx["stage"])
    if spec.search is None:
        raise ConfigError(f"stage {ctx['stage']!r}: spec needs a 'search' section")
    res = tune(spec, executor_name=i.executor)
    metric = spec.metric
    lines = [f"{len(res.trials)} trials, {spec.search.parallel} at a time, selected on validation {metric}:"]
    for t in sorted(res.trials, key=lambda r: r["number"]):
        value = "-" if t["value"] is None else f"{t['value']:.4f}"
        star = " *" if t["run_id"] == res.best_run_id else ""
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items()
        )
        lines.append(f"  trial {t['number']}: {t['state'].lower():<8} {metric}={value}{star}  {params}")
    return {
        "best_params": {**spec.params, **res.best_params},
        "best_run": res.best_run_id,
        "best_value": res.best_value,
        "metric": metric,
        "search_run": res.run_id,
        "trials": len(res.trials),
        "report": lines,
    }


def fit_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """One tracked fit of ``spec`` (params overridden by ``params``) on the train and val rows."""
    from gpuyard.models.fit import fit

    i = parse_inputs(FitInputs, inputs, ctx["stage"])
    spec = _model_spec(i, ctx["stage"])
    res, _model = fit(spec, dict(i.params or {}), evaluate_test=False)
    val = res.evaluations.get("validation", {})
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(val.items()))
    return {
        "run": res.run_id,
        "validation": val,
        "report": [f"run {res.run_id[:8]} ({spec.name}): validation {shown}"],
    }


def _load(inputs: EvaluateInputs | RegisterInputs, stage: str) -> Any:
    # A saved folder wins over the run: a DDP training's run records metrics, the folder holds weights.
    if inputs.model_dir:
        from gpuyard.models.flavors import load_model

        return load_model(inputs.model_dir)[0]
    if inputs.run:
        from gpuyard.models.fit import load_run_model

        return load_run_model(inputs.run)
    raise ConfigError(f"stage {stage!r}: give 'run' (a tracked run) or 'model_dir' (a saved model folder)")


def evaluate_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Score a model on the dataset's held-out ``split`` (default test); ``require`` gates the pipeline.

    Raises:
        ConfigError: a required metric is below (or, for error metrics, above) its threshold.
    """
    from gpuyard.models.evaluate import evaluate, log_evaluation
    from gpuyard.models.metrics import METRICS

    stage = ctx["stage"]
    i = parse_inputs(EvaluateInputs, inputs, stage)
    split = i.split
    data = load_arrays(pin(with_splits(i.dataset, [split])))
    model = _load(i, stage)
    kind = "test" if split == "test" else "holdout"
    ev = evaluate(model, data.X, data.y, i.task, kind, i.metrics)
    if i.run:
        # On the run's own record (an evaluation row, and `test/<metric>` points that `gpuyard runs`
        # and the dashboard show); the run itself finished earlier, so it is not finished again.
        from gpuyard.store import get_store
        from gpuyard.tracking.store import DbTracker

        tracker = DbTracker(get_store(), i.run, system_interval_s=None)
        log_evaluation(tracker, ev, dataset_version=data.version)
        tracker.flush()
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(ev.metrics.items()))
    lines = [f"{data.version}: {ev.n_samples} rows never seen in search or training", f"  {shown}"]
    for metric, bound in (i.require or {}).items():
        value = ev.metrics.get(metric)
        higher = METRICS[metric].direction == "maximize" if metric in METRICS else True
        if value is None or (value < bound if higher else value > bound):
            raise ConfigError(
                f"stage {stage!r}: {split} {metric}={value} does not meet the requirement {bound}"
            )
        lines.append(f"  requirement met: {metric} {'>=' if higher else '<='} {bound}")
    return {"metrics": ev.metrics, "rows": ev.n_samples, "report": lines}


def register_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Register the model (from a run or a folder) and ask for promotion on the dataset's test split."""
    from gpuyard.models.flavors import as_predictor
    from gpuyard.models.promote import promote
    from gpuyard.models.registry import register_folder, register_from_run
    from gpuyard.models.signature import infer_signature

    stage = ctx["stage"]
    i = parse_inputs(RegisterInputs, inputs, stage)
    name, ref, task = i.name, i.dataset, i.task
    holdout = pin(with_splits(ref, ["test"]))
    metrics = {"test": dict(i.metrics or {})}
    if i.run and not i.model_dir:
        # The run's own lineage already names its dataset selection (e.g. NAME@VERSION#split=train,val).
        mv = register_from_run(name, i.run)
    else:
        if not i.model_dir:
            raise ConfigError(f"stage {stage!r}: input 'model_dir' is required (with: {{model_dir: ...}})")
        folder = Path(i.model_dir)
        model = _load(i, stage)
        train = load_arrays(pin(with_splits(ref, ["train"])))
        X = train.X
        signature = infer_signature(X, np.asarray(as_predictor(model, task).predict(X)), task)
        lineage = {
            "dataset_ref": train.version,  # serving's drift reference: the training inputs
            "dataset_version": train.version,
            "run_dir": i.run_dir,
            "metric": i.metric or ("accuracy" if task == "classification" else "mse"),
            "pipeline": ctx["pipeline"],
        }
        run = i.run or None
        mv = register_folder(
            name,
            folder,
            signature=signature,
            run_id=run,
            dataset_version=train.version,
            metrics=metrics,
            lineage=lineage,
        )
    decision = promote(mv.ref, holdout=holdout, metric=i.metric)
    verdict = "promoted to production" if decision.promoted else "not promoted"
    return {
        "model": mv.ref,
        "name": name,
        "version": mv.version,
        "promoted": bool(decision.promoted),
        "report": [f"registered {mv.ref} ({mv.flavor}); {verdict}: {decision.reason}"],
    }
