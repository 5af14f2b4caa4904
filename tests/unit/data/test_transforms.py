"""Recipes: checked before work, fitted on the train split only, saved and re-applied at inference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gpuyard.data import IngestOptions, Recipe, ingest, list_versions, load_recipe, transform
from gpuyard.data.recipe import Split
from gpuyard.data.split import assign
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.store import get_artifacts

pytestmark = pytest.mark.unit

RECIPE = """
derive:
  - {name: ink, expr: "pixels_20 + pixels_21 * 2"}
split: {method: stratified, column: label, seed: 7, kfold: 4}
normalize:
  - {columns: [pixels_20, ink], method: zscore}
  - {columns: [pixels_36], method: minmax}
encode:
  - {column: label, method: ordinal}
augment: {column: image, hflip: 0.5}
"""


def test_recipe_fits_on_train_only_and_reapplies(gpuyard_home: Path, digits_npz: Path) -> None:
    src = ingest(digits_npz, "digits", IngestOptions(label_column="label", shard_bytes=150_000))
    raw = src.to_numpy(["pixels_20", "pixels_21", "pixels_36", "label"])
    out = transform("digits", load_recipe(RECIPE), engine="serial")
    assert out.manifest["parent"] == src.ref and out.manifest["kind"] == "transform"
    assert len(out.shards) == len(src.shards) and out.num_rows == 1797
    cols = out.to_numpy(["split", "fold", "pixels_20", "ink", "pixels_36", "label"])
    train = cols["split"] == "train"
    # Statistics come from the train rows only.
    fit = out.fitted["normalize"]
    assert fit["pixels_20"]["mean"] == pytest.approx(raw["pixels_20"][train].mean())
    assert fit["pixels_20"]["std"] == pytest.approx(raw["pixels_20"][train].std())
    assert fit["pixels_36"]["max"] == raw["pixels_36"][train].max()
    ink = raw["pixels_20"] + raw["pixels_21"] * 2
    np.testing.assert_allclose(
        cols["ink"], (ink - ink[train].mean()) / ink[train].std(), rtol=1e-5, atol=1e-5
    )
    assert abs(cols["pixels_20"][train].mean()) < 1e-5 and abs(cols["pixels_20"][~train].mean()) > 1e-4
    # Stratified: every class keeps its share in every split; folds cover train rows evenly.
    for cls in range(10):
        share = (raw["label"][train] == cls).mean()
        assert share == pytest.approx((raw["label"] == cls).mean(), abs=0.01)
    assert set(cols["fold"][~train]) == {-1}
    counts = np.bincount(cols["fold"][train])
    assert len(counts) == 4 and counts.max() - counts.min() <= 10
    assert out.manifest["splits"] == {"train": int(train.sum()), "val": 180, "test": 179}
    # The same transform applies to new rows at inference time, from the manifest alone.
    fresh = src.to_arrow().slice(100, 20)
    applied = out.transform_for_inference().apply(fresh)
    np.testing.assert_allclose(applied.column("ink").to_numpy(), cols["ink"][100:120], rtol=1e-6)
    np.testing.assert_array_equal(applied.column("label").to_numpy(), raw["label"][100:120])


def test_unknown_column_fails_before_any_work(gpuyard_home: Path, digits_npz: Path) -> None:
    ingest(digits_npz, "digits")
    before = set(get_artifacts().list())
    for text, word in [
        ("normalize: [{columns: [pixels_20, nope]}]", "nope"),
        ("derive: [{name: z, expr: 'missing * 2'}]", "missing"),
        ("encode: [{column: image}]", "image"),
        ("split: {method: time, column: when}", "when"),
    ]:
        with pytest.raises(ConfigError, match=word):
            transform("digits", load_recipe(text), engine="serial")
    assert set(get_artifacts().list()) == before and len(list_versions("digits")) == 1


def test_recipe_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"normalize\.0\.method"):
        load_recipe("normalize: [{columns: [a], method: robust}]")
    with pytest.raises(ConfigError, match="split"):
        load_recipe("split: {fractions: {train: 0.5, test: 0.2}}")
    with pytest.raises(ConfigError, match="mapping"):
        load_recipe("- a\n- b\n")
    with pytest.raises(NotFoundError):
        load_recipe(tmp_path / "none.yaml")


def test_encoding_and_unknown_categories(gpuyard_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "c.csv"
    src.write_text(
        "color,size\n" + "".join(f"{c},{i}\n" for i, c in enumerate(["red", "blue", "red", "green"] * 5))
    )
    ingest(src, "colors")
    out = transform(
        "colors",
        Recipe.model_validate({"encode": [{"column": "color", "method": "onehot"}]}),
        engine="serial",
    )
    assert out.fitted["encode"]["color"]["categories"] == ["blue", "green", "red"]
    assert out.tensor_specs()["color"].shape == (3,)
    onehot = out.to_numpy(["color"])["color"]
    assert onehot.shape == (20, 3) and onehot.sum(axis=1).tolist() == [1] * 20
    assert onehot[:4].argmax(axis=1).tolist() == [2, 0, 2, 1]  # red, blue, red, green
    ft = out.transform_for_inference()
    new = ft.apply(pa.table({"color": ["green", "purple"], "size": [1, 2]}))
    from gpuyard.data.columns import tensor_spec, tensor_to_numpy

    spec = tensor_spec(new.schema.field("color"))
    assert spec is not None
    assert tensor_to_numpy(new.column("color"), spec).tolist() == [[0, 1, 0], [0, 0, 0]]


def test_image_and_text_features(gpuyard_home: Path, image_folder: Path, tmp_path: Path) -> None:
    ingest(image_folder, "imgs")
    out = transform(
        "imgs", load_recipe("image: [{column: image, resize: [4, 4], output: small}]"), engine="serial"
    )
    assert out.tensor_specs()["small"].shape == (4, 4) and out.tensor_specs()["image"].shape == (8, 8)
    text = tmp_path / "t.jsonl"
    text.write_text('{"t": "the cat sat"}\n{"t": "The CAT, the cat"}\n')
    ingest(text, "texts")
    hashed = transform("texts", load_recipe("text_hash: [{column: t, buckets: 16}]"), engine="serial")
    vecs = hashed.to_numpy(["t"])["t"]
    assert vecs.shape == (2, 16) and vecs.sum(axis=1).tolist() == [3.0, 4.0]


def test_splits_random_time_and_seeds() -> None:
    codes, folds = assign(1000, Split(seed=1, kfold=5))
    assert np.bincount(codes).tolist() == [800, 100, 100]
    assert np.array_equal(codes, assign(1000, Split(seed=1))[0])
    assert not np.array_equal(codes, assign(1000, Split(seed=2))[0])
    assert sorted(np.bincount(folds[codes == 0]).tolist()) == [160] * 5
    when = np.random.default_rng(0).permutation(1000)
    tcodes, _ = assign(1000, Split(method="time", column="t", fractions={"train": 0.7, "test": 0.3}), when)
    assert when[tcodes == 0].max() < when[tcodes == 1].min()


def test_without_a_split_fitted_statistics_come_from_the_manifest(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.data.transforms import fit_from_stats, fit_shard, merge_fit

    src = tmp_path / "n.csv"
    rng = np.random.default_rng(0)
    values = rng.normal(5, 2, 500)
    src.write_text("v,w,c\n" + "".join(f"{v},{i % 7},{'xyz'[i % 3]}\n" for i, v in enumerate(values)))
    ds = ingest(src, "nums", IngestOptions(shard_bytes=4000))
    recipe = load_recipe("normalize: [{columns: [v]}, {columns: [w], method: minmax}]\nencode: [{column: c}]")
    from_stats = fit_from_stats(recipe, ds)
    assert from_stats is not None and len(ds.shards) > 1
    from gpuyard.data.transforms import _split_tasks

    tasks, _ = _split_tasks(ds, recipe)
    from_pass = merge_fit(recipe, [fit_shard(t) for t in tasks])
    assert (
        from_stats["encode"]["c"]["categories"] == from_pass["encode"]["c"]["categories"] == ["x", "y", "z"]
    )
    assert from_stats["normalize"]["v"]["mean"] == pytest.approx(
        from_pass["normalize"]["v"]["mean"], rel=1e-12
    )
    assert from_stats["normalize"]["v"]["std"] == pytest.approx(values.std(), rel=1e-9)
    assert from_stats["normalize"]["w"]["max"] == from_pass["normalize"]["w"]["max"] == 6
    assert fit_from_stats(load_recipe("split: {}\nnormalize: [{columns: [v]}]"), ds) is None
    out = transform("nums", recipe, engine="serial")
    assert out.fitted["normalize"]["v"] == from_stats["normalize"]["v"]
    # Threads run the same tasks: the same shards, hence the same content-addressed version.
    threaded = transform(ds.ref, recipe, engine="thread", workers=3, output="nums-threads")
    assert threaded.version == out.version and len(threaded.shards) > 1
    onehot = threaded.to_numpy(["c"])["c"]  # one-hot vectors are stored dictionary-encoded
    assert onehot.dtype == np.uint8 and onehot.shape == (500, 3)
    assert onehot.argmax(axis=1).tolist() == [i % 3 for i in range(500)] and onehot.sum() == 500
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(threaded.shard_paths()[0]).metadata
    column = meta.schema.names.index("c")
    assert "RLE_DICTIONARY" in meta.row_group(0).column(column).encodings


def test_returned_version_is_the_catalogs_for_a_new_and_a_repeated_transform(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from gpuyard.data import open_dataset

    src = tmp_path / "r.csv"
    src.write_text("v,c\n" + "".join(f"{i * 0.5},{'ab'[i % 2]}\n" for i in range(300)))
    ingest(src, "rep", IngestOptions(shard_bytes=2000))
    recipe = load_recipe("normalize: [{columns: [v]}]\nencode: [{column: c}]")
    first = transform("rep", recipe, engine="thread", workers=2, output="rep-out")
    # Built from the manifest just recorded, without reading it back: the same document as stored.
    stored = open_dataset(first.ref)
    assert first.manifest == stored.manifest and first.ref == stored.ref
    # An equal run finds its version recorded already (an earlier created_at): it returns the
    # catalog's manifest, not the one it just built.
    again = transform("rep", recipe, engine="thread", workers=2, output="rep-out")
    assert again.ref == first.ref and again.manifest == stored.manifest
    assert len(list_versions("rep-out")) == 1


def test_a_reopened_shard_with_a_shared_footer_still_checks_page_checksums(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from gpuyard.data.shards import encode_shard, open_parquet, read_groups
    from gpuyard.errors import IntegrityError

    table = pa.table({"x": np.arange(50_000, dtype=np.float64) * 0.37})
    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    data = bytearray(encode_shard(table))
    good.write_bytes(data)
    data[len(data) // 3] ^= 0xFF  # inside a data page; the footer is untouched
    bad.write_bytes(data)
    footer = open_parquet(str(good), "good").metadata
    assert read_groups(open_parquet(str(good), "good", metadata=footer), "good", [0]).equals(table)
    reopened = open_parquet(str(bad), "bad", metadata=footer)
    with pytest.raises(IntegrityError, match="shard bad is truncated or corrupt"):
        read_groups(reopened, "bad", [0])
