"""The one loader of a dataset version into arrays; split-selecting references (NAME@VERSION#split=...)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gpuyard.data import DatasetVersion, IngestOptions, ingest, load_recipe, transform
from gpuyard.data.arrays import (
    available_splits,
    feature_columns,
    load_arrays,
    pin,
    split_arrays,
    with_splits,
)
from gpuyard.errors import ConfigError, NotFoundError

pytestmark = pytest.mark.unit

N = 90


def _source(tmp_path: Path, float_label: bool = False) -> Path:
    """Every kind of column: float, int, bool, text (skipped), a 2x3 uint8 tensor, and the label."""
    rng = np.random.default_rng(3)
    label = rng.normal(size=N) if float_label else rng.integers(0, 3, N)
    path = tmp_path / ("reg.npz" if float_label else "mixed.npz")
    np.savez(
        path,
        a=rng.normal(size=N),
        c=rng.integers(0, 5, N),
        flag=rng.random(N) > 0.5,
        name=np.array([f"row{i}" for i in range(N)]),
        image=rng.integers(0, 255, (N, 2, 3)).astype(np.uint8),
        label=label,
        score=rng.normal(size=N).astype(np.float32),
    )
    return path


@pytest.fixture
def split_version(gpuyard_home: Path, tmp_path: Path) -> tuple[DatasetVersion, DatasetVersion]:
    """(the ingested version, the same with stratified train/val/test and 3 folds) over several shards."""
    raw = ingest(_source(tmp_path), "mixed", IngestOptions(label_column="label", shard_bytes=600))
    recipe = {
        "split": {
            "method": "stratified",
            "column": "label",
            "seed": 0,
            "kfold": 3,
            "fractions": {"train": 0.6, "val": 0.2, "test": 0.2},
        }
    }
    out = transform(raw.ref, load_recipe(recipe), engine="serial")
    assert len(out.shards) > 2 and {"split", "fold"} <= set(out.columns)
    return raw, out


# The two loaders this module replaced (gpuyard.models.gydata.load_gpuyard_dataset and
# gpuyard.pipelines.arrays.split_arrays as of commit 0be4aa4), kept as oracles: models trained through
# either must see the same matrix from the new one.
def _old_gydata(v: DatasetVersion) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    table = v.to_arrow()
    bookkeeping = {"fold"} if "split" in table.column_names else set()
    feats, names, y = [], [], None
    for fld in table.schema:
        if fld.name in bookkeeping:
            continue
        col, spec = table.column(fld.name), v.tensor_specs().get(fld.name)
        if spec is not None:
            from gpuyard.data.columns import tensor_to_numpy

            vals = tensor_to_numpy(col, spec).reshape(table.num_rows, -1)
        elif pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type) or pa.types.is_boolean(fld.type):
            vals = col.to_numpy(zero_copy_only=False).reshape(table.num_rows, -1)
        else:
            continue
        if fld.name == v.label_column:
            y = vals.reshape(-1)
        else:
            feats.append(vals.astype(np.float32))
            names.append(fld.name)
    assert y is not None
    return np.concatenate(feats, axis=1), y, tuple(names)


def _old_split_arrays(v: DatasetVersion, split: str) -> tuple[np.ndarray, np.ndarray]:
    label = str(v.label_column)
    cols = [
        c
        for c in v.columns
        if c not in (label, "split", "fold")
        and (c in v.tensor_specs() or v.stats.get(c, {}).get("kind") in ("int", "float", "bool"))
    ]
    arrays = v.to_numpy([*cols, label], split=split)
    n = len(arrays[label])
    return np.concatenate([arrays[c].reshape(n, -1).astype(np.float32) for c in cols], axis=1), arrays[label]


def test_same_arrays_as_both_old_loaders(split_version: tuple[DatasetVersion, DatasetVersion]) -> None:
    raw, out = split_version
    for v in (raw, out):
        X, y, names = _old_gydata(v)
        new = load_arrays(v.ref)
        assert new.feature_names == names == ("a", "c", "flag", "image", "score")
        assert new.X.dtype == np.float32 and new.X.shape == (N, 1 + 1 + 1 + 6 + 1)
        np.testing.assert_array_equal(new.X, X)
        np.testing.assert_array_equal(new.y, y)
        assert new.y.dtype == np.int64 and new.task == "classification" and new.version == v.ref
    for split in ("train", "val", "test"):
        X, y = _old_split_arrays(out, split)
        new = load_arrays(f"{out.ref}#split={split}")
        np.testing.assert_array_equal(new.X, X)
        np.testing.assert_array_equal(new.y, y)
        assert split_arrays(out.ref, split)[0].tobytes() == X.tobytes()
    assert feature_columns(out, "label") == ["a", "c", "flag", "image", "score"]


def test_selection_keeps_only_those_rows_in_version_order(
    split_version: tuple[DatasetVersion, DatasetVersion],
) -> None:
    _raw, out = split_version
    whole = load_arrays(out.ref)
    split = out.to_numpy(["split"])["split"]
    for chosen in (["train", "val"], ["val", "train"], ["test"]):
        ref = with_splits(out.ref, chosen)
        got = load_arrays(ref)
        mask = np.isin(split, chosen)
        assert 0 < mask.sum() < N and len(got.y) == mask.sum()
        np.testing.assert_array_equal(got.X, whole.X[mask])  # rows of those splits, version order
        np.testing.assert_array_equal(got.y, whole.y[mask])
        assert got.version == f"{out.ref}#split={','.join(chosen)}" and got.splits == tuple(chosen)
    sizes = out.manifest["splits"]
    assert len(load_arrays(f"{out.ref}#split=train,val,test").y) == sum(sizes.values()) == N
    assert available_splits(out) == ("train", "val", "test")


def test_the_recorded_version_is_the_resolved_one(
    split_version: tuple[DatasetVersion, DatasetVersion],
) -> None:
    _raw, out = split_version  # the transformed version is the newest of "mixed"
    for ref in ("mixed#split=test", "mixed@latest#split=test", f"mixed@{out.version[:6]}#split=test"):
        assert pin(ref) == f"mixed@{out.version}#split=test"
        assert load_arrays(ref).version == f"mixed@{out.version}#split=test"
    assert pin("mixed") == out.ref
    assert with_splits(f"{out.ref}#split=a,b", ["c"]) == f"{out.ref}#split=c"
    assert with_splits("x@abcd#split=test", ["train"]) == "x@abcd#split=train"


@pytest.mark.parametrize(
    ("fragment", "problem"),
    [
        ("split=tain", "no split 'tain'"),
        ("split=", "use NAME"),
        ("split=train,,val", "use NAME"),
        ("splits=train", "use NAME"),
        ("fold=1", "use NAME"),
        ("split=train,train", "named twice"),
        ("split=train#x", "use NAME"),
    ],
)
def test_bad_selections_name_the_reference_and_the_splits(
    split_version: tuple[DatasetVersion, DatasetVersion], fragment: str, problem: str
) -> None:
    _raw, out = split_version
    ref = f"{out.ref}#{fragment}"
    with pytest.raises(ConfigError) as err:
        load_arrays(ref)
    msg = str(err.value)
    assert repr(ref) in msg and problem in msg
    assert f"splits present in {out.ref}: train, val, test" in msg


def test_a_version_without_splits_says_so(split_version: tuple[DatasetVersion, DatasetVersion]) -> None:
    raw, _out = split_version
    with pytest.raises(ConfigError, match=r"splits present in mixed@\w+: none: it has no split column"):
        load_arrays(f"{raw.ref}#split=train")
    with pytest.raises(ConfigError, match="already selects splits"):
        split_arrays(f"{raw.ref}#split=train", "test")
    with pytest.raises(NotFoundError, match="nosuch"):
        load_arrays("nosuch@latest#split=train")


def test_float_label_is_regression(gpuyard_home: Path, tmp_path: Path) -> None:
    v = ingest(_source(tmp_path, float_label=True), "reg", IngestOptions(label_column="label"))
    data = load_arrays(v.ref)
    assert data.task == "regression" and data.y.dtype == np.float32 and data.X.dtype == np.float32
    np.testing.assert_allclose(data.y, v.to_numpy(["label"])["label"].astype(np.float32))
    with pytest.raises(ConfigError, match=r"label column 'name' of reg@\w+ is string"):
        split_arrays(v.ref, label="name")


def test_splits_of_an_ingested_split_column(gpuyard_home: Path, tmp_path: Path) -> None:
    # A source may carry its own split column (no recipe, so no split sizes in the manifest).
    rng = np.random.default_rng(1)
    split = np.array(["holdout", "train", "fresh"])[rng.integers(0, 3, 40)]
    np.savez(tmp_path / "own.npz", x=rng.normal(size=40), label=rng.integers(0, 2, 40), split=split)
    v = ingest(tmp_path / "own.npz", "own", IngestOptions(label_column="label"))
    assert "splits" not in v.manifest and available_splits(v) == ("train", "fresh", "holdout")
    got = load_arrays("own#split=fresh,holdout")
    assert got.X.shape == ((split != "train").sum(), 1) and got.feature_names == ("x",)
    with pytest.raises(
        ConfigError, match=r"no split 'test' \(splits present in own@\w+: train, fresh, holdout\)"
    ):
        load_arrays("own#split=test")


def test_permuted_equals_concatenate_then_index_for_every_layout() -> None:
    """The loader's one-pass block gather is ``np.concatenate(parts)[perm]`` for tensor rows, scalars
    and strings, one part or several of unequal lengths; a single part is gathered, not viewed."""
    from gpuyard.data.columns import permuted

    rng = np.random.default_rng(3)
    rows = rng.integers(0, 255, (23, 4, 3), dtype=np.uint8)
    labels = np.arange(23, dtype=np.int64)
    names = np.array([f"s{i}" for i in range(23)], dtype=object)
    perm = rng.permutation(23)
    for whole in (rows, labels, names):
        for cuts in ([], [5], [1, 2, 20]):
            parts = np.split(whole, cuts)
            got = permuted(parts, perm)
            assert got.dtype == whole.dtype and np.array_equal(got, whole[perm])
            assert not np.shares_memory(got, whole)
    # A chunk with nulls decodes as float beside an int chunk: nothing is cast down to int.
    mixed = [np.arange(4, dtype=np.int64), np.array([np.nan, 5.0, 6.0])]
    got = permuted(mixed, perm[perm < 7])
    want = np.concatenate(mixed)[perm[perm < 7]]
    assert got.dtype == np.float64 and np.array_equal(got, want, equal_nan=True)
