"""Models train on a gpuyard dataset version (NAME@VERSION) and record it as their dataset version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuyard.models.datasets import load_dataset
from gpuyard.models.fit import fit
from gpuyard.models.retrain import latest_dataset_version
from gpuyard.models.spec import parse_spec

pytestmark = pytest.mark.integration


def test_fit_on_an_ingested_dataset_version(home: Path, tmp_path: Path) -> None:
    from sklearn.datasets import load_breast_cancer

    from gpuyard.data.ingest import IngestOptions, ingest

    X, y = load_breast_cancer(return_X_y=True)
    np.savez(tmp_path / "cancer.npz", X=X.astype(np.float32), y=y.astype(np.int64))
    version = ingest(tmp_path / "cancer.npz", "cancer", IngestOptions(label_column="y"))
    ds = load_dataset(version.ref)
    assert ds.version == version.ref and ds.task == "classification"
    assert ds.X.shape == X.shape and sorted(np.unique(ds.y).tolist()) == [0, 1]
    # rows may be reordered by ingestion, never changed: same multiset of labels and row sums
    assert np.bincount(ds.y).tolist() == np.bincount(y).tolist()
    assert np.allclose(np.sort(ds.X.sum(axis=1)), np.sort(X.astype(np.float32).sum(axis=1)), rtol=1e-5)
    assert latest_dataset_version("cancer") == (version.ref, version.ref)
    spec = parse_spec(
        {
            "name": "c",
            "dataset": version.ref,
            "trainer": "gpuyard.models.builtin:train_sklearn",
            "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 3},
        }
    )
    result, _ = fit(spec)
    assert result.evaluations["test"]["accuracy"] > 0.8
    from gpuyard.models.runs import get_run

    assert get_run(result.run_id).dataset_version == version.ref


def test_split_and_fold_columns_are_not_features(home: Path, tmp_path: Path) -> None:
    # A recipe's k-fold step adds an integer "fold" column: bookkeeping, not something to learn from.
    from gpuyard.data.ingest import IngestOptions, ingest
    from gpuyard.data.recipe import load_recipe
    from gpuyard.data.transforms import transform

    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    version = ingest(tmp_path / "d.npz", "folds", IngestOptions(label_column="y"))
    recipe = load_recipe({"split": {"method": "stratified", "column": "y", "kfold": 3, "seed": 1}})
    folded = transform(version.ref, recipe, engine="serial")
    assert "fold" in folded.columns
    ds = load_dataset(folded.ref)
    assert ds.X.shape == (120, 5)
    assert "fold" not in ds.feature_names and "split" not in ds.feature_names
