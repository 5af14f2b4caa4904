"""Pipeline model stages read the dataset version through split selection: no npz snapshots, lineage kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform

pytestmark = pytest.mark.unit

TREE = {
    "name": "tree",
    "trainer": "gpuyard.models.builtin:train_sklearn",
    "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 4},
    "split": {"val": 0.2, "test": 0.1, "seed": 0},
}


@pytest.fixture
def wine(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """scikit-learn's wine (178 rows, 13 columns) with a stratified train/val/test split column."""
    from sklearn.datasets import load_wine

    X, y = load_wine(return_X_y=True)
    np.savez(tmp_path / "wine.npz", X=X.astype(np.float32), y=y.astype(np.int64))
    raw = ingest(tmp_path / "wine.npz", "wine", IngestOptions(label_column="y"))
    split = {
        "method": "stratified",
        "column": "y",
        "seed": 0,
        "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
    }
    return transform(raw.ref, load_recipe({"split": split}), engine="serial")


def _ctx(tmp_path: Path, stage: str) -> dict[str, Any]:
    work = tmp_path / "stages" / stage
    work.mkdir(parents=True)
    return {"workdir": str(work), "base": str(tmp_path), "pipeline": "p", "stage": stage}


def test_fit_evaluate_register_name_the_dataset_version(wine: DatasetVersion, tmp_path: Path) -> None:
    from gpuyard.models.registry import get_version
    from gpuyard.models.runs import get_run, run_details
    from gpuyard.pipelines.stages.models import evaluate_stage, fit_stage, register_stage

    sizes = wine.manifest["splits"]
    fitted = fit_stage({"dataset": "wine", "spec": TREE}, _ctx(tmp_path, "fit"))
    assert get_run(fitted["run"]).dataset_version == f"{wine.ref}#split=train,val"

    test = evaluate_stage({"dataset": wine.ref, "run": fitted["run"]}, _ctx(tmp_path, "test"))
    assert test["rows"] == sizes["test"]
    held_out = [e for e in run_details(fitted["run"])["evaluations"] if e["split"] == "test"]
    assert [(e["dataset_version"], e["n"]) for e in held_out] == [(f"{wine.ref}#split=test", sizes["test"])]

    reg = register_stage(
        {"name": "wine", "dataset": wine.ref, "run": fitted["run"], "metrics": test["metrics"]},
        _ctx(tmp_path, "register"),
    )
    mv = get_version(reg["model"])
    assert reg["promoted"] and mv.dataset_version == f"{wine.ref}#split=train,val"
    assert mv.lineage["dataset_ref"] == f"{wine.ref}#split=train,val"
    assert not list((tmp_path / "stages").rglob("*.npz"))  # nothing snapshotted beside the version


def test_register_a_model_folder(wine: DatasetVersion, tmp_path: Path) -> None:
    from sklearn.tree import DecisionTreeClassifier

    from gpuyard.data.arrays import load_arrays
    from gpuyard.models.datasets import load_dataset
    from gpuyard.models.flavors import save_model
    from gpuyard.models.registry import get_version
    from gpuyard.pipelines.stages.models import register_stage

    train = load_arrays(f"{wine.ref}#split=train")
    save_model(
        DecisionTreeClassifier(max_depth=3, random_state=0).fit(train.X, train.y),
        tmp_path / "m",
        "classification",
    )
    reg = register_stage(
        {"name": "w", "dataset": "wine@latest", "model_dir": str(tmp_path / "m"), "metric": "accuracy"},
        _ctx(tmp_path, "register"),
    )
    mv = get_version(reg["model"])
    assert mv.dataset_version == mv.lineage["dataset_ref"] == f"{wine.ref}#split=train"
    assert mv.lineage["dataset_version"] == f"{wine.ref}#split=train"
    # Serving's drift reference is built from lineage["dataset_ref"]: exactly the training rows.
    np.testing.assert_array_equal(load_dataset(mv.lineage["dataset_ref"]).X, train.X)
    assert not list((tmp_path / "stages").rglob("*.npz"))


def test_a_stage_selection(wine: DatasetVersion, tmp_path: Path) -> None:
    from gpuyard.errors import ConfigError
    from gpuyard.models.runs import get_run
    from gpuyard.pipelines.stages.models import fit_stage

    own = fit_stage({"dataset": "wine#split=train", "spec": TREE}, _ctx(tmp_path, "own"))
    assert get_run(own["run"]).dataset_version == f"{wine.ref}#split=train"
    chosen = {"dataset": "wine#split=train", "splits": ["train", "test"], "spec": TREE}
    wide = fit_stage(chosen, _ctx(tmp_path, "wide"))
    assert get_run(wide["run"]).dataset_version == f"{wine.ref}#split=train,test"
    with pytest.raises(
        ConfigError, match=r"no split 'holdout' \(splits present in wine@\w+: train, val, test\)"
    ):
        fit_stage({"dataset": wine.ref, "splits": ["holdout"], "spec": TREE}, _ctx(tmp_path, "bad"))
