"""Model management on split-selecting references: runs, registry lineage and promotion name the version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform
from gpuyard.errors import ConfigError
from gpuyard.models.datasets import load_dataset

pytestmark = pytest.mark.unit


@pytest.fixture
def cancer(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """breast_cancer (569 rows, 30 columns) with a stratified train/val/test split column."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    np.savez(tmp_path / "c.npz", X=X.astype(np.float32), y=y.astype(np.int64))
    raw = ingest(tmp_path / "c.npz", "cancer", IngestOptions(label_column="y"))
    split = {
        "method": "stratified",
        "column": "y",
        "seed": 0,
        "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
    }
    return transform(raw.ref, load_recipe({"split": split}), engine="serial")


def test_load_dataset_selects_splits_and_records_the_version(cancer: DatasetVersion) -> None:
    sizes = cancer.manifest["splits"]
    ds = load_dataset("cancer@latest#split=train,val")
    assert ds.version == f"{cancer.ref}#split=train,val" and ds.task == "classification"
    assert ds.X.shape == (sizes["train"] + sizes["val"], 30) and ds.y.dtype == np.int64
    assert "split" not in ds.feature_names and len(ds.feature_names) == 30
    test = load_dataset("cancer#split=test")
    assert test.version == f"{cancer.ref}#split=test" and len(test.y) == sizes["test"]
    # The selected rows together are the whole version, none twice.
    whole = load_dataset(cancer.ref)
    assert len(whole.y) == len(ds.y) + len(test.y)
    assert np.allclose(np.sort(whole.X.sum(1)), np.sort(np.concatenate([ds.X, test.X]).sum(1)))


def test_bad_references(cancer: DatasetVersion) -> None:
    with pytest.raises(ConfigError, match=r"scikit-learn sets have no splits"):
        load_dataset("sklearn:digits#split=train")
    with pytest.raises(
        ConfigError, match=r"'cancer#split=tset'.*splits present in cancer@\w+: train, val, test"
    ):
        load_dataset("cancer#split=tset")
    with pytest.raises(ConfigError, match=r"use sklearn:NAME, npz:PATH, NAME@VERSION or NAME@VERSION#split"):
        load_dataset("no such/thing")


def test_fit_register_promote_record_the_selection(cancer: DatasetVersion) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.promote import promote
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.runs import get_run, run_details
    from gpuyard.models.spec import parse_spec

    spec = parse_spec(
        {
            "name": "tree",
            "dataset": "cancer@latest#split=train,val",
            "trainer": "gpuyard.models.builtin:train_sklearn",
            "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 3},
            "split": {"val": 0.2, "test": 0.2, "seed": 0},
        }
    )
    result, _model = fit(spec)
    trainval = f"{cancer.ref}#split=train,val"
    assert get_run(result.run_id).dataset_version == trainval
    evals = run_details(result.run_id)["evaluations"]
    assert {e["dataset_version"] for e in evals} == {trainval}
    # The run's own test split is cut from train+val only: it never holds a row of the version's test split.
    sizes = cancer.manifest["splits"]
    assert sum(e["n"] for e in evals) < sizes["train"] + sizes["val"]

    mv = register_from_run("tree", result.run_id)
    assert mv.dataset_version == trainval
    # Serving builds its drift reference from lineage["dataset_ref"] through load_dataset.
    assert len(load_dataset(str(mv.lineage["dataset_ref"])).y) == sizes["train"] + sizes["val"]

    decision = promote(mv.ref, holdout="cancer#split=test")
    assert decision.promoted and decision.holdout == f"{cancer.ref}#split=test"
    assert decision.n_samples == sizes["test"]
