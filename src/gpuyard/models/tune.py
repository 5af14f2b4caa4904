"""Hyperparameter search with Optuna: each trial a task (a job), trials in parallel, studies in the database.

Where Optuna keeps its studies (:func:`optuna_storage`): Optuna creates and migrates its own tables
(``studies``, ``trials``, ... and its own ``alembic_version``), which would collide with gpuyard's
Alembic version table if both lived side by side. So they live apart but in the same database:
on PostgreSQL in the schema ``optuna`` of the state store's database (gpuyard's Alembic comparison
only looks at the default schema); on SQLite, which has no schemas, in the file ``<db>-optuna.db``
next to the state store. Neither is part of gpuyard's migrations.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.models.features import feature_usage
from gpuyard.models.spec import ModelSpec, SearchSpec, parse_spec
from gpuyard.scheduler.executors.tasks import Task, TaskExecutor, get_executor
from gpuyard.settings import Settings, load_settings
from gpuyard.states import RunStatus
from gpuyard.tracking.store import append_metrics, start_run

OPTUNA_SCHEMA = "optuna"


def optuna_storage(settings: Settings | None = None) -> Any:
    """Optuna's RDB storage for the configured state store (see the module docstring for where).

    One per process and database: a worker running many trials reuses its connections.
    """
    settings = settings or load_settings()
    return _storage_for(settings)


@functools.lru_cache(maxsize=4)
def _storage_for(settings: Settings) -> Any:
    import optuna
    from sqlalchemy import text

    from gpuyard.store import get_store

    if settings.is_sqlite:
        db = settings.database_url.split(":///", 1)[1]
        base = db[:-3] if db.endswith(".db") else db
        url = f"sqlite:///{base}-optuna.db"
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}}
    else:
        with get_store(settings).engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {OPTUNA_SCHEMA}"))
        url = settings.database_url
        kwargs = {"connect_args": {"options": f"-csearch_path={OPTUNA_SCHEMA}"}, "pool_pre_ping": True}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def _ask_tell_grid_sampler(space: dict[str, list[Any]], seed: int) -> Any:
    import optuna

    class AskTellGridSampler(optuna.samplers.GridSampler):
        """GridSampler whose after_trial does not call ``study.stop()``, which only works inside
        ``study.optimize``; here each trial is its own ask/tell job and the trial count is capped at
        the grid's size instead."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return AskTellGridSampler(space, seed=seed)


def make_sampler(search: SearchSpec, seed: int) -> Any:
    """The Optuna sampler the spec asks for, seeded."""
    import optuna

    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        return _ask_tell_grid_sampler(grid_space(search), seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, search.startup_trials))


def make_pruner(search: SearchSpec) -> Any:
    """The Optuna pruner the spec asks for (NopPruner for none)."""
    import optuna

    if search.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=search.startup_trials, n_warmup_steps=1)
    if search.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    return optuna.pruners.NopPruner()


def grid_space(search: SearchSpec) -> dict[str, list[Any]]:
    """Every value of every parameter, for the grid sampler."""
    import numpy as np

    space: dict[str, list[Any]] = {}
    for name, p in search.space.items():
        if p.choices:
            space[name] = list(p.choices)
        elif p.type == "int":
            space[name] = list(range(int(p.low or 0), int(p.high or 0) + 1, int(p.step or 1)))
        else:
            if p.low is None or p.high is None or p.step is None:
                raise ConfigError(f"search.space.{name}: grid search needs low, high and step")
            space[name] = [float(v) for v in np.arange(p.low, p.high + p.step / 2, p.step)]
    return space


def suggest(trial: Any, search: SearchSpec) -> dict[str, Any]:
    """Ask the trial for a value of every parameter of the space."""
    params: dict[str, Any] = {}
    for name, p in search.space.items():
        if p.type == "categorical":
            params[name] = trial.suggest_categorical(name, p.choices)
        elif p.type == "int":
            params[name] = trial.suggest_int(
                name, int(p.low or 0), int(p.high or 0), step=int(p.step or 1), log=p.log
            )
        else:
            params[name] = trial.suggest_float(
                name, float(p.low or 0), float(p.high or 0), step=p.step, log=p.log
            )
    return params


def run_trial(spec: dict[str, Any], study_name: str, parent_id: str, index: int) -> dict[str, Any]:
    """One trial: ask the study for params, fit with pruning reports, tell the result (a job's body)."""
    import optuna

    from gpuyard.models.builtin import Pruned
    from gpuyard.models.fit import fit

    model_spec = parse_spec(spec, "tune trial spec")
    search = model_spec.search
    if search is None:
        raise ConfigError("tune trial spec has no search section")
    # Each trial its own sampler seed: parallel workers with one seed would draw the same points.
    # Except the grid: it shuffles its points by the seed and hands trial N point N, so every
    # worker must shuffle alike.
    seed = model_spec.seed if search.sampler == "grid" else model_spec.seed + index
    study = optuna.load_study(
        study_name=study_name,
        storage=optuna_storage(),
        sampler=make_sampler(search, seed),
        pruner=make_pruner(search),
    )
    trial = study.ask()
    params = suggest(trial, search)

    def reporter(step: int, value: float) -> None:
        trial.report(value, step)
        if trial.should_prune():
            raise Pruned(f"trial {trial.number} pruned at step {step}")

    try:
        result, _ = fit(
            model_spec,
            params,
            kind="trial",
            parent_id=parent_id,
            name=f"{model_spec.name}-t{trial.number}",
            evaluate_test=False,
            reporter=reporter,
        )
    except Exception as exc:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return {
            "number": trial.number,
            "state": "FAIL",
            "error": f"{type(exc).__name__}: {exc}",
            "params": params,
        }
    trial.set_user_attr("run_id", result.run_id)
    if result.status == RunStatus.PRUNED:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return {"number": trial.number, "state": "PRUNED", "run_id": result.run_id, "params": params}
    value = result.score("validation", model_spec.metric)
    if value is None:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return {"number": trial.number, "state": "FAIL", "error": "no validation score", "params": params}
    study.tell(trial, value)
    return {
        "number": trial.number,
        "state": "COMPLETE",
        "value": value,
        "run_id": result.run_id,
        "params": params,
    }


@dataclass(frozen=True)
class TuneResult:
    """The search run, its study, the best trial and its test-split metrics."""

    run_id: str
    study_name: str
    best_run_id: str
    best_params: dict[str, Any]
    best_value: float
    test_metrics: dict[str, float]
    trials: list[dict[str, Any]] = field(default_factory=list)
    features: dict[str, Any] = field(default_factory=dict)


def trial_rows(study: Any) -> list[dict[str, Any]]:
    """The study's trials as plain rows (number, state, value, last intermediate step, params, run)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        last = max(t.intermediate_values) if t.intermediate_values else None
        rows.append(
            {
                "number": t.number,
                "state": t.state.name,
                "value": t.value,
                "step": last,
                "params": dict(t.params),
                "run_id": t.user_attrs.get("run_id"),
            }
        )
    return rows


def tune(
    spec: ModelSpec,
    *,
    executor: TaskExecutor | None = None,
    executor_name: str = "pool",
    on_progress: Callable[[list[dict[str, Any]]], None] | None = None,
    poll_s: float = 0.5,
) -> TuneResult:
    """Search ``spec.search.space`` with Optuna, each trial a task run by the executor.

    Trials are selected on the validation split; only the best is then evaluated on the test split
    (recorded on the best trial's run, apart from validation).

    Raises:
        ConfigError: no search section; every trial failed (the first error is quoted).
    """
    import optuna

    from gpuyard.models.evaluate import evaluate, record_evaluation
    from gpuyard.models.fit import load_run_model, pinned_spec, spec_splits, split_note, split_tag
    from gpuyard.models.spec import task_for_data

    search = spec.search
    if search is None:
        raise ConfigError(f"spec {spec.name!r} has no 'search' section to tune")
    spec = pinned_spec(spec)  # every trial reads this one version, whatever is ingested meanwhile
    ds, data = spec_splits(spec)
    task = task_for_data(spec, ds)  # a contradiction (also among the search's estimators) stops here
    usage = feature_usage(spec.dataset, ds).with_notes(split_note(spec, ds))
    tracker = start_run(
        f"{spec.name}-tune",
        experiment=spec.experiment,
        kind="tune",
        dataset_version=ds.version,
        params={
            "sampler": search.sampler,
            "pruner": search.pruner,
            "n_trials": search.n_trials,
            "parallel": search.parallel,
            **spec.params,
        },
        tags={
            "metric": spec.metric,
            "direction": spec.resolved_direction,
            "trainer": spec.trainer,
            "dataset_ref": spec.dataset,
            "split": split_tag(spec, ds),
            **usage.run_tags(),
        },
    )
    study_name = f"{spec.name}-{tracker.run_id[:12]}"
    storage = optuna_storage()
    study = optuna.create_study(study_name=study_name, storage=storage, direction=spec.resolved_direction)
    tracker.set_tags({"study": study_name})
    n_trials = search.n_trials
    if search.sampler == "grid":
        n_trials = min(n_trials, len(_grid_points(search)))
    own = executor is None
    ex = executor or get_executor(executor_name, search.parallel)
    doc = spec.model_dump(mode="json")
    try:
        futures = [
            ex.submit(
                Task(
                    "gpuyard.models.tune:run_trial",
                    dict(spec=doc, study_name=study_name, parent_id=tracker.run_id, index=i),
                    name=f"trial {i}",
                )
            )
            for i in range(n_trials)
        ]
        while not all(f.done() for f in futures):
            if on_progress is not None:
                on_progress(trial_rows(study))
            time.sleep(poll_s)
        outcomes = [f.result() for f in futures]
    except BaseException as exc:
        tracker.finish(RunStatus.FAILED, error=str(exc)[:2000])
        raise
    finally:
        if own:
            ex.shutdown()
    rows = trial_rows(study)
    if on_progress is not None:
        on_progress(rows)
    complete = [o for o in outcomes if o["state"] == "COMPLETE"]
    if not complete:
        errors = [o.get("error") for o in outcomes if o.get("error")]
        msg = f"every trial of {study_name} failed or was pruned" + (
            f"; first error: {errors[0]}" if errors else ""
        )
        tracker.finish(RunStatus.FAILED, error=msg)
        raise ConfigError(msg)
    for o in outcomes:
        if o["state"] == "COMPLETE":
            tracker.log_metrics(o["number"], {f"trial/{spec.metric}": o["value"]})
    best = study.best_trial
    best_run = str(best.user_attrs["run_id"])
    test_metrics: dict[str, float] = {}
    if len(data.X_test):  # a selection of train and val rows has no test rows: nothing to score here
        model = load_run_model(best_run)
        test_ev = evaluate(model, data.X_test, data.y_test, task, "test")
        record_evaluation(test_ev, run_id=best_run, dataset_version=ds.version, store=tracker.store)
        test_metrics = test_ev.metrics
        append_metrics(best_run, int(best.last_step or 0), {f"test/{k}": v for k, v in test_metrics.items()})
    tracker.set_tags({"best_run_id": best_run, "best_params": best.params, "best_trial": best.number})
    tracker.log_metrics(
        n_trials,
        {
            f"best/validation_{spec.metric}": float(best.value or 0.0),
            **{f"best/test_{k}": v for k, v in test_metrics.items()},
        },
    )
    tracker.finish(RunStatus.FINISHED)
    return TuneResult(
        tracker.run_id,
        study_name,
        best_run,
        dict(best.params),
        float(best.value or 0.0),
        test_metrics,
        rows,
        usage.to_json(),
    )


def _grid_points(search: SearchSpec) -> list[tuple[Any, ...]]:
    import itertools

    return list(itertools.product(*grid_space(search).values()))


def params_of_run(ref: str) -> dict[str, Any]:
    """The params a run used (e.g. the best trial's), to fit or cross-validate with them again."""
    from gpuyard.models.runs import get_run

    params = dict(get_run(ref).params)
    params.pop("trainer", None)
    return params
