"""Model stages: search (Optuna, trials in parallel), fit, evaluate on the held-out split, register + promote.

Data comes from a dataset version with a ``split`` column. Search and fit see only the ``train`` and
``val`` rows (written as an ``npz:`` dataset in the stage's folder, which model management splits
again for selection); the ``test`` rows are read only by :func:`evaluate_stage` and promotion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.pipelines.arrays import split_arrays, write_npz
from gpuyard.pipelines.stages import need


def _model_spec(inputs: dict[str, Any], ctx: dict[str, Any]) -> Any:
    from gpuyard.models.spec import parse_spec

    stage = ctx["stage"]
    ref = str(need(inputs, "dataset", stage))
    doc = dict(need(inputs, "spec", stage))
    npz = write_npz(ref, list(inputs.get("splits", ["train", "val"])), Path(ctx["workdir"]) / "trainval.npz")
    doc["dataset"] = f"npz:{npz}"
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
    ref, task = str(need(inputs, "dataset", stage)), str(inputs.get("task", "classification"))
    split = str(inputs.get("split", "test"))
    model = _load(inputs, stage)
    X, y = split_arrays(ref, split)
    ev = evaluate(model, X, y, task, "test" if split == "test" else "holdout", inputs.get("metrics"))
    if inputs.get("run"):
        # On the run's own record (an evaluation row, and `test/<metric>` points that `gpuyard runs`
        # and the dashboard show); the run itself finished earlier, so it is not finished again.
        from gpuyard.models.tracking import DbTracker
        from gpuyard.store import get_store

        tracker = DbTracker(get_store(), str(inputs["run"]), system_interval_s=None)
        log_evaluation(tracker, ev, dataset_version=f"{ref} split={split}")
        tracker.flush()
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(ev.metrics.items()))
    lines = [f"{split} split of {ref}: {ev.n_samples} rows never seen in search or training", f"  {shown}"]
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
    work = Path(ctx["workdir"])
    test_npz = write_npz(ref, ["test"], work / "holdout.npz")
    train_npz = write_npz(ref, ["train"], work / "train.npz")
    metrics = {"test": dict(inputs.get("metrics") or {})}
    if inputs.get("run") and not inputs.get("model_dir"):
        mv = register_from_run(name, str(inputs["run"]))
    else:
        folder = Path(str(need(inputs, "model_dir", stage)))
        model = _load(inputs, stage)
        X, _y = split_arrays(ref, "train")
        signature = infer_signature(X, np.asarray(as_predictor(model, task).predict(X)), task)
        lineage = {
            "dataset_ref": f"npz:{train_npz}",  # serving's drift reference: the training inputs
            "dataset_version": ref,
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
            dataset_version=ref,
            metrics=metrics,
            lineage=lineage,
        )
    decision = promote(mv.ref, holdout=f"npz:{test_npz}", metric=inputs.get("metric"))
    verdict = "promoted to production" if decision.promoted else "not promoted"
    return {
        "model": mv.ref,
        "name": name,
        "version": mv.version,
        "promoted": bool(decision.promoted),
        "report": [f"registered {mv.ref} ({mv.flavor}); {verdict}: {decision.reason}"],
    }
