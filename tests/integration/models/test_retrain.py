"""Continuous learning: a new dataset version or a drift alert -> train -> register -> promote when better."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.models.registry import get_version, list_versions, model_events
from gpuyard.models.retrain import on_drift_alert, run_policy

pytestmark = pytest.mark.integration


def _write_data(path: Path, rows: int, noise: float, seed: int) -> None:
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(X))[:rows]
    X = X[idx] + rng.normal(0, noise, size=X[idx].shape) * X.std(0)
    np.savez(path, X=X.astype(np.float32), y=y[idx].astype(np.int64))


def test_policy_bootstraps_then_retrains_on_new_data_and_drift(home: Path, tmp_path: Path) -> None:
    data = tmp_path / "cancer.npz"
    _write_data(data, 150, noise=1.5, seed=0)  # few, noisy rows: a weak first model
    (tmp_path / "spec.yaml").write_text(
        json.dumps(
            {
                "name": "cancer",
                "dataset": f"npz:{data}",
                "trainer": "gpuyard.models.builtin:train_sklearn",
                "params": {"estimator": "sklearn.linear_model.LogisticRegression", "max_iter": 5000},
                "split": {"val": 0.2, "test": 0.3, "seed": 0},
            }
        )
    )
    (tmp_path / "policy.yaml").write_text(
        json.dumps({"model": "cancer", "spec": "spec.yaml", "cooldown": "1s"})
    )
    policy = tmp_path / "policy.yaml"

    first = run_policy(policy)
    assert first["decision"]["reasons"] == ["no version of the model is in production"]
    assert first["promotion"]["promoted"] and get_version("cancer@production").version == 1
    assert run_policy(policy)["decision"]["retrain"] is False  # nothing new

    _write_data(data, 569, noise=0.0, seed=1)  # a new version of the file: all rows, clean
    dry = run_policy(policy, dry_run=True)
    assert dry["decision"]["retrain"] and "new dataset version" in dry["decision"]["reasons"][0]
    assert len(list_versions("cancer")) == 1  # a dry run changes nothing
    second = run_policy(policy)
    v2 = get_version(second["challenger"])
    assert v2.dataset_version == dry["decision"]["dataset_version"] != get_version("cancer:1").dataset_version
    # promoted exactly when it beat production on the same holdout rows
    p = second["promotion"]
    assert p["promoted"] == (p["challenger_score"] > p["production_score"])
    assert get_version("cancer@production").version == (2 if p["promoted"] else 1)
    assert run_policy(policy)["decision"]["retrain"] is False  # this data version is handled

    # Serving reports drift: the hook records it, the next pass retrains.
    import time

    time.sleep(1.1)  # the policy's cooldown is 1 s: let it pass (a wall-clock rule, not a wait for a result)
    out = on_drift_alert(
        "cancer",
        1,
        [
            {
                "kind": "input_drift",
                "feature": "f0",
                "metric": "psi",
                "value": 0.4,
                "threshold": 0.2,
                "window": 500,
            }
        ],
    )
    assert out["recorded"] == 1
    third = run_policy(policy)
    assert third["decision"]["retrain"] and "drift alert" in third["decision"]["reasons"][0]
    actions = [e["action"] for e in model_events("cancer")]
    assert actions.count("retrain") == 3 and "drift_alert" in actions


def test_retrain_cli_dry_run_and_bad_policy(home: Path, tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(
        json.dumps(
            {
                "name": "iris",
                "dataset": "sklearn:iris",
                "trainer": "gpuyard.models.builtin:train_sklearn",
                "params": {"estimator": "sklearn.tree.DecisionTreeClassifier"},
            }
        )
    )
    (tmp_path / "p.yaml").write_text(json.dumps({"model": "iris", "spec": "spec.yaml"}))
    runner = CliRunner()
    out = runner.invoke(app, ["models", "retrain", str(tmp_path / "p.yaml"), "--dry-run"])
    assert out.exit_code == 0 and "no version of the model is in production" in out.stdout
    (tmp_path / "bad.yaml").write_text(
        json.dumps({"model": "iris", "spec": "spec.yaml", "triggers": {"evry": "1d"}})
    )
    out = runner.invoke(app, ["models", "retrain", str(tmp_path / "bad.yaml")])
    assert out.exit_code != 0
