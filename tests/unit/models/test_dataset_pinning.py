"""Dataset references keep ``#split=`` and name a concrete version in caches, lineage and retraining.

Each test makes a second version of the dataset after the first was used, as a new ingest does: what
was recorded or cached must still name (and serve) the rows that were read, and "is there newer data"
must compare like with like.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform

pytestmark = pytest.mark.unit

SPLIT = {
    "method": "stratified",
    "column": "y",
    "seed": 0,
    "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
}
TREE = {
    "name": "tree",
    "trainer": "gpuyard.models.builtin:train_sklearn",
    "params": {"estimator": "sklearn.tree.DecisionTreeClassifier", "max_depth": 3},
    "split": {"val": 0.2, "test": 0.2, "seed": 0},
}


def _version(tmp_path: Path, rows: int) -> DatasetVersion:
    """A new version of dataset ``cancer``: the first ``rows`` rows of breast_cancer, split 60/20/20."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    src = tmp_path / f"cancer-{rows}.npz"
    np.savez(src, X=X[:rows].astype(np.float32), y=y[:rows].astype(np.int64))
    raw = ingest(src, "cancer", IngestOptions(label_column="y"))
    return transform(raw.ref, load_recipe({"split": SPLIT}), engine="serial")


@pytest.fixture
def v1(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    return _version(tmp_path, 300)


def test_pin_dataset_resolves_the_version_and_keeps_the_split(v1: DatasetVersion) -> None:
    from gpuyard.errors import ConfigError
    from gpuyard.models.datasets import pin_dataset

    assert pin_dataset("cancer@latest#split=train,val") == f"{v1.ref}#split=train,val"
    assert pin_dataset("cancer#split=test") == f"{v1.ref}#split=test"
    assert pin_dataset(f"cancer@{v1.version[:6]}") == v1.ref
    assert pin_dataset("sklearn:iris") == "sklearn:iris"
    with pytest.raises(ConfigError, match=r"no split 'holdout'"):
        pin_dataset("cancer#split=holdout")
    with pytest.raises(ConfigError, match=r"use sklearn:NAME, npz:PATH"):
        pin_dataset("no such/thing")


def test_cached_latest_serves_the_new_version_after_an_ingest(v1: DatasetVersion, tmp_path: Path) -> None:
    from gpuyard.models.fit import cached_dataset

    first = cached_dataset("cancer@latest#split=train")
    assert first.version == f"{v1.ref}#split=train" and len(first.y) == v1.manifest["splits"]["train"]
    v2 = _version(tmp_path, 569)
    second = cached_dataset("cancer@latest#split=train")
    assert second.version == f"{v2.ref}#split=train" and len(second.y) == v2.manifest["splits"]["train"]
    assert cached_dataset(f"{v1.ref}#split=train") is first  # a pinned version is served from the cache


def test_fit_and_tune_record_the_resolved_reference(v1: DatasetVersion, tmp_path: Path) -> None:
    from gpuyard.models.fit import fit
    from gpuyard.models.promote import holdout_for
    from gpuyard.models.registry import register_from_run
    from gpuyard.models.runs import get_run
    from gpuyard.models.spec import parse_spec
    from gpuyard.models.tune import tune

    trainval = f"{v1.ref}#split=train,val"
    result, _ = fit(parse_spec({**TREE, "dataset": "cancer@latest#split=train,val"}))
    run = get_run(result.run_id)
    assert run.dataset_version == trainval and run.tags["dataset_ref"] == trainval
    mv = register_from_run("tree", result.run_id)
    assert mv.lineage["dataset_ref"] == trainval

    v2 = _version(tmp_path, 569)
    # Promotion's default holdout is the test split of record of the version it was trained on: v1's.
    X, _, described = holdout_for(mv)
    assert described == f"{v1.ref}#split=test (the test split of record)" and v2.ref not in described
    assert len(X) == v1.manifest["splits"]["test"]

    search = {"sampler": "random", "n_trials": 2, "parallel": 1}
    search["space"] = {"max_depth": {"type": "int", "low": 2, "high": 4}}
    tuned = tune(
        parse_spec({**TREE, "dataset": "cancer#split=train", "search": search}), executor_name="inline"
    )
    assert get_run(tuned.run_id).tags["dataset_ref"] == f"{v2.ref}#split=train"
    trials = [get_run(t["run_id"]) for t in tuned.trials]
    assert {(t.dataset_version, t.tags["dataset_ref"]) for t in trials} == {(f"{v2.ref}#split=train",) * 2}


def test_retrain_watches_the_same_split_of_the_newest_version(v1: DatasetVersion, tmp_path: Path) -> None:
    from gpuyard.models.registry import get_version
    from gpuyard.models.retrain import latest_dataset_version, run_policy

    selected = f"{v1.ref}#split=train,val"
    assert latest_dataset_version("cancer#split=train,val") == (selected, selected)
    assert latest_dataset_version(selected) == (selected, selected)

    (tmp_path / "spec.yaml").write_text(json.dumps({**TREE, "dataset": "cancer#split=train,val"}))
    (tmp_path / "policy.yaml").write_text(json.dumps({"model": "cancer", "spec": "spec.yaml"}))
    policy = tmp_path / "policy.yaml"
    first = run_policy(policy)
    assert first["decision"]["dataset_version"] == selected
    assert get_version("cancer@production").dataset_version == selected
    # Production trained on these very rows: no new data, no retrain.
    assert run_policy(policy)["decision"]["retrain"] is False

    v2 = _version(tmp_path, 569)
    newer = f"{v2.ref}#split=train,val"
    assert latest_dataset_version(selected) == (newer, newer)
    second = run_policy(policy)
    assert second["decision"]["retrain"] and second["decision"]["dataset_version"] == newer
    challenger = get_version(second["challenger"])
    assert challenger.dataset_version == challenger.lineage["dataset_ref"] == newer
    assert run_policy(policy)["decision"]["retrain"] is False
