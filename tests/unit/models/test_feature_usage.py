"""fit, cv and tune say which columns they train on, and name each column they leave out and why.

The case behind it: an ``income`` column with four stray words among numbers became text, and a fit
silently trained on the other columns. Now ingest keeps it numeric, and whatever is left out (a text
column not encoded) is named in the result, on stderr, and on the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpuyard.cli.main import main
from gpuyard.data import IngestOptions, ValidationSpec, ingest
from gpuyard.data.validate import ColumnCheck

pytestmark = pytest.mark.unit

STRAY = {17: "unknown", 400: "n/a?", 999: "refused", 1500: "ask later"}
SPEC = {
    "name": "people-tree",
    "experiment": "people",
    "trainer": "gpuyard.models.builtin:train_sklearn",
    "metric": "accuracy",
    "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 4, "random_state": 0},
    "split": {"val": 0.2, "test": 0.2, "seed": 0},
}


def _people_csv(path: Path, n: int = 2000) -> Path:
    """age, income, score, tenure, city -> label; income carries most of the signal and 4 stray words."""
    rng = np.random.default_rng(0)
    age = rng.integers(18, 80, n)
    income = rng.normal(50000, 15000, n).round(0)
    score = rng.normal(0, 1, n).round(3)
    tenure = rng.integers(0, 30, n)
    logit = 0.00012 * (income - 50000) + 0.8 * score + 0.02 * (age - 50) - 0.05 * (tenure - 15)
    y = (logit + rng.logistic(size=n) * 0.5 > 0).astype(int)
    lines = ["age,income,score,tenure,city,label"]
    for i in range(n):
        inc = STRAY.get(i, str(int(income[i])))
        lines.append(f"{age[i]},{inc},{score[i]},{tenure[i]},{['paris', 'rome', 'oslo'][i % 3]},{y[i]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _spec(tmp_path: Path, dataset: str) -> Path:
    path = tmp_path / f"{dataset}.yaml"
    path.write_text(yaml.safe_dump({**SPEC, "dataset": dataset}))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_uses_income_and_names_the_text_column_it_leaves_out(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.runs import get_run
    from gpuyard.models.spec import parse_spec

    ingest(_people_csv(tmp_path / "people.csv"), "people", IngestOptions(label_column="label"))
    result, _ = fit(parse_spec({**SPEC, "dataset": "people"}, "spec"))
    assert result.features["used"] == ["age", "income", "score", "tenure"]
    assert list(result.features["dropped"]) == ["city"]
    assert "text" in result.features["dropped"]["city"] and "encode" in result.features["dropped"]["city"]
    assert result.features["label"] == "label"
    tags = get_run(result.run_id).tags
    assert tags["features"] == ["age", "income", "score", "tenure"] and "city" in tags["dropped_features"]
    accuracy = result.score("test", "accuracy")
    # Without income (kept as text, as before inference) the same model does far worse.
    checks = ValidationSpec(columns={"income": ColumnCheck(type="str")})
    ingest(tmp_path / "people.csv", "as-text", IngestOptions(label_column="label", checks=checks))
    without, _ = fit(parse_spec({**SPEC, "dataset": "as-text"}, "spec"))
    assert without.features["used"] == ["age", "score", "tenure"]
    why = without.features["dropped"]["income"]
    assert "99.8% of its values are numbers" in why and "type: float" in why
    assert accuracy is not None and accuracy > (without.score("test", "accuracy") or 0) + 0.1


def test_cli_fit_lists_features_and_warns_on_stderr(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ingest(_people_csv(tmp_path / "people.csv", 300), "people", IngestOptions(label_column="label"))
    spec = _spec(tmp_path, "people")
    code, out, err = _run(capsys, "models", "fit", str(spec))
    assert code == 0
    assert "features (4 of 5 columns): age, income, score, tenure; label: label" in out
    assert "warning: column 'city' not used: it is text" in " ".join(err.split())
    code, out, err = _run(capsys, "models", "fit", str(spec), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["features"]["used"] == ["age", "income", "score", "tenure"]
    assert "city" in doc["features"]["dropped"] and "'city' not used" in err


def test_cv_and_tune_report_the_features(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.models.cv import cross_validate
    from gpuyard.models.runs import get_run
    from gpuyard.models.spec import parse_spec
    from gpuyard.models.tune import tune
    from gpuyard.scheduler.executors.tasks import InlineExecutor

    ingest(_people_csv(tmp_path / "people.csv", 300), "people", IngestOptions(label_column="label"))
    spec = parse_spec({**SPEC, "dataset": "people"}, "spec")
    cv = cross_validate(spec, folds=2, executor=InlineExecutor())
    assert cv.features["used"] == ["age", "income", "score", "tenure"] and list(cv.features["dropped"]) == [
        "city"
    ]
    assert get_run(cv.run_id).tags["dropped_features"].keys() == {"city"}
    search = {
        "sampler": "grid",
        "n_trials": 2,
        "space": {"max_depth": {"type": "categorical", "choices": [2, 3]}},
    }
    tuned = tune(
        parse_spec({**SPEC, "dataset": "people", "search": search}, "spec"), executor=InlineExecutor()
    )
    assert tuned.features["used"] == ["age", "income", "score", "tenure"]
    assert list(tuned.features["dropped"]) == ["city"]


def test_sklearn_sets_name_their_features(gpuyard_home: Path) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.spec import parse_spec

    result, _ = fit(parse_spec({**SPEC, "dataset": "sklearn:iris"}, "spec"), keep_model=False)
    assert result.features["used"][0] == "sepal length (cm)" and result.features["dropped"] == {}
