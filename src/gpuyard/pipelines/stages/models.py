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
from gpuyard.pipelines.stages import need
from gpuyard.refs import DatasetRef


def _selection(inputs: dict[str, Any], stage: str, default: list[str]) -> str:
    """The stage's dataset with the version resolved, selecting ``splits`` (or its own, or ``default``)."""
    ref = str(need(inputs, "dataset", stage))
    if inputs.get("splits"):
        return pin(with_splits(ref, [str(s) for s in inputs["splits"]]))
    return pin(ref if DatasetRef.has_selection(ref) else with_splits(ref, default))


def _model_spec(inputs: dict[str, Any], ctx: dict[str, Any]) -> Any:
    from gpuyard.models.spec import parse_spec

    stage = ctx["stage"]
    doc = dict(need(inputs, "spec", stage))
    doc["dataset"] = _selection(inputs, stage, ["train", "val"])
    return parse_spec(doc, f"stage {stage}: spec")


def tune_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameter search with model management's Optuna search; outputs the best params and run."""
    from gpuyard.models.tune import tune

    spec = _model_spec(inputs, ctx)
    if spec.search is None:
        raise ConfigError(f"stage {ctx['stage']!r}: spec needs a 'search' section")
    res = tune(spec, executor_name=str(inputs.get("executor", "pool")))
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

    spec = _model_spec(inputs, ctx)
    res, _model = fit(spec, dict(inputs.get("params") or {}), evaluate_test=False)
    val = res.evaluations.get("validation", {})
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(val.items()))
    return {
        "run": res.run_id,
        "validation": val,
        "report": [f"run {res.run_id[:8]} ({spec.name}): validation {shown}"],
    }


def _load(inputs: dict[str, Any], stage: str) -> Any:
    # A saved folder wins over the run: a DDP training's run records metrics, the folder holds weights.
    if inputs.get("model_dir"):
        from gpuyard.models.flavors import load_model

        return load_model(str(inputs["model_dir"]))[0]
    if inputs.get("run"):
        from gpuyard.models.fit import load_run_model

        return load_run_model(str(inputs["run"]))
    raise ConfigError(f"stage {stage!r}: give 'run' (a tracked run) or 'model_dir' (a saved model folder)")


def evaluate_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Score a model on the dataset's held-out ``split`` (default test); ``require`` gates the pipeline.

    Raises:
        ConfigError: a required metric is below (or, for error metrics, above) its threshold.
    """
    from gpuyard.models.evaluate import evaluate, log_evaluation
    from gpuyard.models.metrics import METRICS

    stage = ctx["stage"]
    task = str(inputs.get("task", "classification"))
    split = str(inputs.get("split", "test"))
    data = load_arrays(pin(with_splits(str(need(inputs, "dataset", stage)), [split])))
    model = _load(inputs, stage)
    kind = "test" if split == "test" else "holdout"
    ev = evaluate(model, data.X, data.y, task, kind, inputs.get("metrics"))
    if inputs.get("run"):
        # On the run's own record (an evaluation row, and `test/<metric>` points that `gpuyard runs`
        # and the dashboard show); the run itself finished earlier, so it is not finished again.
        from gpuyard.store import get_store
        from gpuyard.tracking.store import DbTracker

        tracker = DbTracker(get_store(), str(inputs["run"]), system_interval_s=None)
        log_evaluation(tracker, ev, dataset_version=data.version)
        tracker.flush()
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(ev.metrics.items()))
    lines = [f"{data.version}: {ev.n_samples} rows never seen in search or training", f"  {shown}"]
    for metric, bound in dict(inputs.get("require") or {}).items():
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
    name, ref = str(need(inputs, "name", stage)), str(need(inputs, "dataset", stage))
    task = str(inputs.get("task", "classification"))
    holdout = pin(with_splits(ref, ["test"]))
    metrics = {"test": dict(inputs.get("metrics") or {})}
    if inputs.get("run") and not inputs.get("model_dir"):
        # The run's own lineage already names its dataset selection (e.g. NAME@VERSION#split=train,val).
        mv = register_from_run(name, str(inputs["run"]))
    else:
        folder = Path(str(need(inputs, "model_dir", stage)))
        model = _load(inputs, stage)
        train = load_arrays(pin(with_splits(ref, ["train"])))
        X = train.X
        signature = infer_signature(X, np.asarray(as_predictor(model, task).predict(X)), task)
        lineage = {
            "dataset_ref": train.version,  # serving's drift reference: the training inputs
            "dataset_version": train.version,
            "run_dir": inputs.get("run_dir"),
            "metric": inputs.get("metric", "accuracy" if task == "classification" else "mse"),
            "pipeline": ctx["pipeline"],
        }
        run = str(inputs["run"]) if inputs.get("run") else None
        mv = register_folder(
            name,
            folder,
            signature=signature,
            run_id=run,
            dataset_version=train.version,
            metrics=metrics,
            lineage=lineage,
        )
    decision = promote(mv.ref, holdout=holdout, metric=inputs.get("metric"))
    verdict = "promoted to production" if decision.promoted else "not promoted"
    return {
        "model": mv.ref,
        "name": name,
        "version": mv.version,
        "promoted": bool(decision.promoted),
        "report": [f"registered {mv.ref} ({mv.flavor}); {verdict}: {decision.reason}"],
    }
