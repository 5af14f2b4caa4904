"""A version's split of record (its recipe's split) is the only split: no test row reaches a fitted
statistic or a training batch, in a fit, a cross-validation, a search or a promotion.

The source plants extreme values (1e6) in exactly the rows the recipe's seeded split will call
``test``: any of them in the recipe's fitted mean, in the rows handed to the trainer, or in a fold
shows at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform
from gpuyard.data.split import assign
from gpuyard.models.datasets import Splits

pytestmark = pytest.mark.unit

SPLIT = {
    "method": "stratified",
    "column": "y",
    "seed": 3,
    "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
}
PLANTED = 1e6
SEEN: list[dict[str, np.ndarray]] = []


def capture(params: dict[str, Any], data: Splits, ctx: Any) -> Any:
    """A trainer that records the rows it is given, then fits a small tree."""
    from sklearn.tree import DecisionTreeClassifier

    SEEN.append({"X_train": data.X_train.copy(), "X_val": data.X_val.copy(), "X_test": data.X_test.copy()})
    model = DecisionTreeClassifier(max_depth=2, random_state=0).fit(data.X_train, data.y_train)
    if len(data.X_val):
        ctx.report(0, ctx.score(model, data.X_val, data.y_val))
    return model


@pytest.fixture
def planted(gpuyard_home: Path, tmp_path: Path) -> tuple[DatasetVersion, np.ndarray]:
    """A version split 60/20/20 whose test rows alone hold x0 = 1e6 (and the codes of its split)."""
    from gpuyard.data.recipe import Split

    rng = np.random.default_rng(0)
    n = 200
    y = (np.arange(n) % 2).astype(np.int64)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    codes, _ = assign(n, Split(**SPLIT), y)  # what the recipe's split step will decide, row by row
    test_code = list(SPLIT["fractions"]).index("test")
    X[codes == test_code, 0] = PLANTED
    src = tmp_path / "planted.npz"
    np.savez(src, X=X, y=y)
    raw = ingest(src, "planted", IngestOptions(label_column="y"))
    recipe = load_recipe({"split": SPLIT, "normalize": [{"columns": ["X_0", "X_1", "X_2"]}]})
    version = transform(raw.ref, recipe, engine="serial")
    SEEN.clear()
    return version, codes


def _spec(dataset: str, **extra: Any) -> Any:
    from gpuyard.models.spec import parse_spec

    doc = {"name": "leak", "dataset": dataset, "trainer": f"{__name__}:capture", **extra}
    return parse_spec(doc)


def _no_planted(X: np.ndarray) -> bool:
    # z-scored with train statistics, a planted row sits thousands of deviations away.
    return bool(len(X) == 0 or np.abs(X).max() < 50)


def test_statistics_are_fitted_on_train_rows_only(planted: tuple[DatasetVersion, np.ndarray]) -> None:
    version, codes = planted
    z = version.fitted["normalize"]["X_0"]
    assert abs(z["mean"]) < 1 and z["std"] < 5  # one planted 1e6 would move the mean by ~5000
    arrays = version.to_numpy(["X_0", "split"])
    test_rows = arrays["split"] == "test"
    assert test_rows.sum() == (codes == 2).sum()
    assert np.abs(arrays["X_0"][~test_rows]).max() < 5  # train/val rows scaled by train-only statistics
    assert np.abs(arrays["X_0"][test_rows]).min() > 1000


def test_fit_trains_and_tests_on_the_split_of_record(planted: tuple[DatasetVersion, np.ndarray]) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.runs import get_run

    version, codes = planted
    # The spec asks for its own cut: ignored for the split of record, with one line naming the leak.
    result, _ = fit(_spec(version.ref, split={"val": 0.3, "test": 0.3, "seed": 9}))
    seen = SEEN[-1]
    assert _no_planted(seen["X_train"]) and _no_planted(seen["X_val"])
    assert len(seen["X_train"]) == (codes == 0).sum() and len(seen["X_val"]) == (codes == 1).sum()
    assert (np.abs(seen["X_test"][:, 0]) > 1000).all() and len(seen["X_test"]) == (codes == 2).sum()
    notes = result.features.get("notes") or []
    assert len(notes) == 1 and "split of record" in notes[0] and "leak" in notes[0]
    tag = get_run(result.run_id).tags["split"]
    assert tag["of_record"] == version.ref and tag["rows"]["test"] == (codes == 2).sum()
    assert result.evaluations["test"] and result.evaluations["validation"]


def test_cv_folds_cut_train_rows_only(planted: tuple[DatasetVersion, np.ndarray]) -> None:
    from gpuyard.models.cv import cross_validate

    version, codes = planted
    result = cross_validate(_spec(version.ref), folds=3, executor_name="inline")
    assert len(result.fold_runs) == 3 and len(SEEN) == 3
    for seen in SEEN:
        assert _no_planted(seen["X_train"]) and _no_planted(seen["X_val"]) and len(seen["X_test"]) == 0
    # The folds' validation parts are the train rows, each once; no validation or test row is in any.
    assert sum(len(s["X_val"]) for s in SEEN) == (codes == 0).sum()
    assert all(len(s["X_train"]) + len(s["X_val"]) == (codes == 0).sum() for s in SEEN)


def test_a_train_only_selection_validates_on_train_rows(planted: tuple[DatasetVersion, np.ndarray]) -> None:
    from gpuyard.models.fit import fit

    version, codes = planted
    result, _ = fit(_spec(f"{version.ref}#split=train"))
    seen = SEEN[-1]
    assert len(seen["X_train"]) + len(seen["X_val"]) == (codes == 0).sum() and len(seen["X_val"]) > 0
    assert len(seen["X_test"]) == 0 and "test" not in result.evaluations
