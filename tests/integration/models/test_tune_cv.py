"""Search and cross-validation: trials and folds as tasks in parallel processes, studies in the database."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.errors import ConfigError
from gpuyard.models.cv import cross_validate
from gpuyard.models.runs import best_run, get_run, list_runs, run_details
from gpuyard.models.spec import parse_spec
from gpuyard.models.tune import tune
from gpuyard.scheduler.executors.tasks import InlineExecutor, Task, TaskFailed, get_executor

pytestmark = pytest.mark.integration

TREE = {
    "name": "tree",
    "experiment": "search",
    "dataset": "sklearn:digits",
    "trainer": "gpuyard.models.builtin:train_sklearn",
    "params": {"estimator": "sklearn.tree.DecisionTreeClassifier"},
    "metric": "f1_macro",
}


def test_grid_search_covers_the_grid_and_picks_the_best(any_db: str) -> None:
    spec = parse_spec(
        {
            **TREE,
            "search": {
                "sampler": "grid",
                "n_trials": 50,
                "space": {"max_depth": {"type": "int", "low": 2, "high": 8, "step": 3}},
            },
        }
    )
    result = tune(spec, executor=InlineExecutor())
    depths = sorted(r["params"]["max_depth"] for r in result.trials)
    assert depths == [2, 5, 8]  # the grid, each point once, n_trials capped at its size
    values = {r["params"]["max_depth"]: r["value"] for r in result.trials}
    assert result.best_value == max(values.values()) and result.best_params["max_depth"] == max(
        values, key=values.get
    )
    best = run_details(result.best_run_id)
    splits = {e["split"] for e in best["evaluations"]}
    assert splits == {"validation", "test"}  # the test split is scored only for the selected trial
    assert result.test_metrics["f1_macro"] == pytest.approx(
        next(e for e in best["evaluations"] if e["split"] == "test")["metrics"]["f1_macro"]
    )
    picked, value = best_run("f1_macro", parent_id=result.run_id)  # selection by declared metric
    assert picked.id == result.best_run_id and value == pytest.approx(result.best_value)
    with pytest.raises(ConfigError, match="unknown metric"):
        best_run("f1", parent_id=result.run_id)
    with pytest.raises(ConfigError, match="better when maximized"):
        best_run("f1_macro", "minimize")
    trials = list_runs(parent_id=result.run_id)
    assert len(trials) == 3 and all(t.kind == "trial" for t in trials)
    assert not any(
        e["split"] == "test"
        for t in trials
        if t.id != result.best_run_id
        for e in run_details(t.id)["evaluations"]
    )


def test_optuna_tables_stay_out_of_gpuyard_schema(any_db: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import inspect

    from gpuyard.store import get_store
    from gpuyard.store.tables import Base

    spec = parse_spec(
        {
            **TREE,
            "search": {
                "sampler": "random",
                "n_trials": 1,
                "space": {"max_depth": {"type": "int", "low": 2, "high": 4}},
            },
        }
    )
    tune(spec, executor=InlineExecutor())
    store = get_store()
    assert "trials" not in inspect(store.engine).get_table_names()
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    current, heads = store.revision_status()
    assert current == heads
    if any_db == "postgresql":
        assert "trials" in inspect(store.engine).get_table_names(schema="optuna")


def test_parallel_tpe_search_with_pruning_in_worker_processes(home: Path) -> None:
    spec = parse_spec(
        {
            "name": "mlp",
            "experiment": "search",
            "dataset": "sklearn:digits",
            "metric": "accuracy",
            "params": {"epochs": 4, "hidden": 16},
            "search": {
                "sampler": "tpe",
                "pruner": "median",
                "n_trials": 4,
                "parallel": 2,
                "startup_trials": 1,
                "space": {"lr": {"type": "float", "low": 1e-4, "high": 5e-2, "log": True}},
            },
        }
    )
    seen: list[int] = []
    result = tune(spec, executor_name="pool", on_progress=lambda rows: seen.append(len(rows)))
    assert len(result.trials) == 4 and seen and max(seen) == 4
    pids = {
        get_run(r["run_id"]).tags.get("split") and run_details(r["run_id"])["system"]["pid"]
        for r in result.trials
        if r["run_id"]
    }
    assert len(pids) == 2  # two worker processes ran the trials
    states = {r["state"] for r in result.trials}
    assert states <= {"COMPLETE", "PRUNED"} and "COMPLETE" in states
    for r in result.trials:
        assert get_run(r["run_id"]).status == ("pruned" if r["state"] == "PRUNED" else "finished")
    assert 0.5 < result.test_metrics["accuracy"] <= 1.0


def test_every_trial_failing_is_one_clear_error(home: Path) -> None:
    spec = parse_spec(
        {
            **TREE,
            "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "colour": 1},
            "search": {
                "sampler": "random",
                "n_trials": 2,
                "space": {"max_depth": {"type": "int", "low": 2, "high": 4}},
            },
        }
    )
    with pytest.raises(ConfigError, match=r"no parameter.*colour"):
        tune(spec, executor=InlineExecutor())


def test_cross_validation_folds_in_parallel_report_mean_and_std(home: Path) -> None:
    spec = parse_spec(
        {**TREE, "params": {**TREE["params"], "max_depth": 6}, "cv": {"folds": 2, "parallel": 2}}
    )
    result = cross_validate(spec, executor_name="subprocess")
    assert len(result.fold_runs) == 2
    folds = result.per_fold["f1_macro"]
    assert result.summary["f1_macro"] == pytest.approx((np.mean(folds), np.std(folds)))
    assert len(set(folds)) > 1  # different folds, different scores
    parent = get_run(result.run_id)
    assert parent.kind == "cv" and parent.latest["cv/f1_macro_mean"] == pytest.approx(np.mean(folds))
    children = list_runs(parent_id=result.run_id)
    assert {c.kind for c in children} == {"fold"} and {c.dataset_version for c in children} == {
        result.dataset_version
    }
    assert {c.tags["fold"] for c in children} == {"0/2", "1/2"}
    # the pool and one-process-per-fold give the same numbers: a fold depends only on the spec
    again = cross_validate(spec, executor=InlineExecutor())
    assert again.per_fold["f1_macro"] == pytest.approx(folds)


def test_executor_reports_task_failures(home: Path) -> None:
    with get_executor("subprocess", 1) as ex:
        fut = ex.submit(Task("gpuyard.models.nope:missing", {}, name="ghost"))
        with pytest.raises(TaskFailed, match=r"ghost.*cannot import module"):
            fut.result()
    with pytest.raises(ConfigError, match="unknown executor"):
        get_executor("kubernetes", 1)


def test_commands_alone_tune_cv_register_promote(home: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                **TREE,
                "cv": {"folds": 2},
                "search": {
                    "sampler": "random",
                    "n_trials": 2,
                    "space": {"max_depth": {"type": "int", "low": 3, "high": 9}},
                },
            }
        )
    )
    runner = CliRunner()
    out = runner.invoke(app, ["tune", str(spec), "--executor", "inline", "--json"])
    assert out.exit_code == 0, out.output
    best = json.loads(out.stdout)["best_run_id"]
    out = runner.invoke(app, ["cv", str(spec), "--params-from", best[:8], "--executor", "inline", "--json"])
    assert out.exit_code == 0, out.output
    assert set(json.loads(out.stdout)["summary"]) >= {"accuracy", "f1_macro"}
    assert runner.invoke(app, ["models", "register", "digits-tree", "--run", best[:8]]).exit_code == 0
    out = runner.invoke(app, ["models", "promote", "digits-tree:1"])
    assert out.exit_code == 0 and "promoted" in out.stdout
    out = runner.invoke(app, ["tune", str(tmp_path / "missing.yaml")])
    assert out.exit_code != 0
