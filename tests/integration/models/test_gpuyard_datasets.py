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
