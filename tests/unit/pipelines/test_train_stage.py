"""The DDP training stage's spec: one resolved version for every rank, recorded with its training split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit

SPLIT = {
    "method": "stratified",
    "column": "y",
    "seed": 0,
    "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
}


def _wine(tmp_path: Path, rows: int) -> tuple[DatasetVersion, DatasetVersion]:
    """(raw, split) versions of dataset ``wine`` from its first ``rows`` rows."""
    from sklearn.datasets import load_wine

    X, y = load_wine(return_X_y=True)
    np.savez(tmp_path / f"wine{rows}.npz", X=X[:rows].astype(np.float32), y=y[:rows].astype(np.int64))
    raw = ingest(tmp_path / f"wine{rows}.npz", "wine", IngestOptions(label_column="y"))
    return raw, transform(raw.ref, load_recipe({"split": SPLIT}), engine="serial")


def test_the_spec_names_the_resolved_version_and_records_the_train_split(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from gpuyard.pipelines.stages.train import train_spec

    _, wine = _wine(tmp_path, 178)
    spec = train_spec({"dataset": "wine@latest", "params": {"hidden": 32}}, tmp_path / "run")
    assert spec["tracking"]["dataset"] == f"{wine.ref}#split=train"
    assert spec["tracking"]["tags"]["validation"] == f"{wine.ref}#split=val"
    # Every rank and the model's normalisation read that one version, not whatever latest is then.
    assert spec["model"]["kwargs"]["dataset"] == wine.ref
    assert {spec["data"][k]["kwargs"]["dataset"] for k in ("train", "val")} == {wine.ref}
    assert [spec["data"][k]["kwargs"]["split"] for k in ("train", "val")] == ["train", "val"]

    _, newer = _wine(tmp_path, 150)
    assert newer.ref != wine.ref
    pinned = train_spec({"dataset": wine.ref}, tmp_path / "run")
    assert pinned["tracking"]["dataset"] == f"{wine.ref}#split=train"
    assert (
        train_spec({"dataset": "wine"}, tmp_path / "run")["tracking"]["dataset"] == f"{newer.ref}#split=train"
    )


def test_bad_dataset_references_are_refused_before_training(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.pipelines.stages.train import train_spec

    raw, _ = _wine(tmp_path, 178)
    with pytest.raises(ConfigError, match=r"stage 'fit-ddp': dataset 'wine#split=train' selects splits"):
        train_spec({"dataset": "wine#split=train"}, tmp_path / "run", "fit-ddp")
    with pytest.raises(ConfigError, match=r"no split 'train' \(splits present in wine@\w+: none"):
        train_spec({"dataset": raw.ref}, tmp_path / "run")
