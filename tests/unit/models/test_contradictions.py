"""A spec that contradicts its data is a configuration error (exit 2, one line), never a silent switch:
a metric, a task or a scikit-learn estimator of the other kind than the label."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError
from gpuyard.models.spec import parse_spec

pytestmark = pytest.mark.unit

SK = "gpuyard.models.builtin:train_sklearn"
TREE = {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 2}


def _spec(**doc: Any) -> Any:
    return parse_spec({"name": "m", "trainer": SK, "params": TREE, **doc})


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        # mse on a 0/1 label used to switch the task to regression and exit 0
        (
            {"dataset": "sklearn:breast_cancer", "metric": "mse"},
            r"metric 'mse' is a regression metric but the label of sklearn:breast_cancer\S* is "
            r"categorical \(integer or bool label, 2 classes\)",
        ),
        (
            {"dataset": "sklearn:diabetes", "metric": "accuracy", "params": {"estimator": "x"}},
            r"metric 'accuracy' is a classification metric but the label .* is continuous",
        ),
        (
            {"dataset": "sklearn:breast_cancer", "task": "regression", "metric": "mae"},
            r"task: regression contradicts the data: .* categorical .*store the label as float",
        ),
        (
            {
                "dataset": "sklearn:breast_cancer",
                "params": {"estimator": "sklearn.linear_model.LinearRegression"},
            },
            r"estimator sklearn.linear_model.LinearRegression is a regressor but the label .* categorical",
        ),
        (
            {
                "dataset": "sklearn:diabetes",
                "metric": "mse",
                "params": {"estimator": "sklearn.tree.DecisionTreeClassifier"},
            },
            r"estimator sklearn.tree.DecisionTreeClassifier is a classifier but the label .* continuous",
        ),
    ],
)
def test_a_contradiction_is_refused_before_training(gpuyard_home: Path, doc: dict, message: str) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.runs import list_runs

    with pytest.raises(ConfigError, match=message):
        fit(_spec(**doc))
    assert list_runs() == []  # refused before a run was started


def test_a_regressor_among_the_search_choices_is_refused(gpuyard_home: Path) -> None:
    from gpuyard.models.tune import tune

    space = {"estimator": {"type": "categorical", "choices": [TREE["estimator"], "sklearn.svm.SVR"]}}
    spec = _spec(dataset="sklearn:iris", search={"sampler": "random", "n_trials": 2, "space": space})
    with pytest.raises(ConfigError, match=r"estimator sklearn.svm.SVR is a regressor"):
        tune(spec, executor_name="inline")


def test_the_cli_exits_2_with_one_line(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"name": "m", "dataset": "sklearn:breast_cancer", "metric": "mse"}))
    for argv in (["models", "fit", str(spec)], ["cv", str(spec), "--executor", "inline"]):
        code = 0
        try:
            main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        assert code == 2, (argv, out, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "metric 'mse' is a regression metric" in lines[0], err


def test_probability_metrics_and_mlp_labels_are_checked_up_front(gpuyard_home: Path, tmp_path: Path) -> None:
    import numpy as np

    from gpuyard.models.fit import fit

    svm = {"estimator": "sklearn.svm.SVC"}
    with pytest.raises(ConfigError, match=r"metric 'roc_auc' needs class probabilities.*sklearn.svm.SVC"):
        fit(_spec(dataset="sklearn:breast_cancer", metric="roc_auc", params=svm))
    src = tmp_path / "pm.npz"
    rng = np.random.default_rng(0)
    np.savez(src, X=rng.normal(size=(40, 3)).astype(np.float32), y=np.where(np.arange(40) % 2, 1, -1))
    spec = parse_spec({"name": "m", "dataset": f"npz:{src}", "trainer": "gpuyard.models.builtin:train_mlp"})
    with pytest.raises(ConfigError, match=r"train_mlp needs class labels 0..K-1.* has -1"):
        fit(spec)
