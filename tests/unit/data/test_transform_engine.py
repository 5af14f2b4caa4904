"""The transform engine: results equal to pandas' on edge cases, streaming equal to the whole shard.

A recipe's fitted steps run on Arrow and NumPy in pieces of a few row groups; these tests hold them to
what pandas computes for the same recipe (nulls, NaN, booleans, categories unseen at fit, empty
frames), to the statistics a full pass would record, and to one layout whatever the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuyard.data import IngestOptions, Recipe, ValidationSpec, ingest, transform
from gpuyard.data.columns import tensor_spec, tensor_to_numpy
from gpuyard.data.fitted import FittedTransform
from gpuyard.data.shards import ShardWriter, encode_shard
from gpuyard.data.stats import finish, merge, partial_stats, table_stats
from gpuyard.data.transforms import onehot_partial

pytestmark = pytest.mark.unit

CATS = ["blue", "green", "red"]
FITTED = {
    "normalize": {
        "x": {"method": "zscore", "mean": 1.5, "std": 2.0, "n": 10},
        "n": {"method": "minmax", "min": -3.0, "max": 5.0, "n": 10},
        "flag": {"method": "zscore", "mean": 0.25, "std": 0.5, "n": 10},
        "const": {"method": "minmax", "min": 4.0, "max": 4.0, "n": 10},
    },
    "encode": {
        "color": {"method": "onehot", "categories": CATS},
        "size": {"method": "ordinal", "categories": ["L", "M", "S"]},
    },
}
RECIPE = Recipe.model_validate(
    {
        "normalize": [
            {"columns": ["x", "flag"], "method": "zscore"},
            {"columns": ["n", "const"], "method": "minmax"},
        ],
        "encode": [{"column": "color", "method": "onehot"}, {"column": "size", "method": "ordinal"}],
        "drop": ["junk"],
    }
)


def _pandas(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """The recipe the pandas way: float64 arithmetic, then float32; get_dummies over the fitted categories."""
    out: dict[str, np.ndarray] = {}
    for col, p in FITTED["normalize"].items():
        v = frame[col].astype("float64")
        shift, scale = (p["mean"], p["std"]) if p["method"] == "zscore" else (p["min"], p["max"] - p["min"])
        out[col] = ((v - shift) * (1.0 / (scale or 1.0))).astype(np.float32).to_numpy()
    # A category unseen at fit is missing for pandas too (pandas 4 refuses it in the Categorical).
    color = pd.Categorical(frame["color"].where(frame["color"].isin(CATS)), categories=CATS)
    out["color"] = pd.get_dummies(color, dtype=np.uint8).to_numpy().reshape(len(frame), len(CATS))
    sizes = FITTED["encode"]["size"]["categories"]
    size = pd.Categorical(frame["size"].where(frame["size"].isin(sizes)), categories=sizes)
    out["size"] = np.asarray(size.codes, dtype=np.int32)
    return out


def _frame(rows: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(1, 3, rows)
    x[rng.random(rows) < 0.1] = np.nan
    return pd.DataFrame(
        {
            "x": x,
            "n": pd.array(rng.integers(-3, 6, rows), dtype="Int64"),
            "flag": rng.random(rows) < 0.3,
            "const": np.full(rows, 4.0),
            "color": rng.choice(["red", "blue", "green", "purple", None], rows),  # purple: unseen at fit
            "size": rng.choice(["S", "M", "L", "XL", None], rows),
            "junk": rng.integers(0, 9, rows),
        }
    )


def _table(frame: pd.DataFrame, null_every: int = 7) -> pa.Table:
    table = pa.Table.from_pandas(frame, preserve_index=False)
    # Nulls, not only NaN, in the numeric columns (pandas reads both as missing).
    n = table.column("n").to_pylist()
    table = table.set_column(1, "n", pa.array([None if i % null_every == 0 else v for i, v in enumerate(n)]))
    return table


def _check_against_pandas(got: pa.Table, frame: pd.DataFrame, table: pa.Table) -> None:
    want = _pandas(table.to_pandas())
    assert "junk" not in got.column_names
    for col in FITTED["normalize"]:
        values = got.column(col)
        assert values.type == pa.float32()
        ours = values.to_numpy(zero_copy_only=False)
        missing = np.isnan(want[col])
        # Missing in, null out (NaN and nulls alike); every other value the same float32 as pandas'.
        np.testing.assert_array_equal(values.is_null().to_numpy(zero_copy_only=False), missing)
        np.testing.assert_array_equal(ours[~missing], want[col][~missing])
    assert np.all(got.column("const").to_numpy(zero_copy_only=False) == 0)  # constant: 0, not NaN
    spec = tensor_spec(got.schema.field("color"))
    assert spec is not None and spec.shape == (3,) and spec.dtype == "uint8"
    np.testing.assert_array_equal(tensor_to_numpy(got.column("color"), spec), want["color"])
    np.testing.assert_array_equal(got.column("size").to_numpy(), want["size"])  # -1 for XL and null


@pytest.mark.parametrize("rows", [0, 1, 257, 5000])
def test_apply_equals_pandas_on_nulls_unseen_categories_and_empty_frames(rows: int) -> None:
    frame = _frame(rows)
    table = _table(frame)
    got = FittedTransform(RECIPE, FITTED).apply(table)
    _check_against_pandas(got, frame, table)
    assert got.num_rows == rows


def test_apply_over_many_chunks_and_dictionary_text_equals_pandas() -> None:
    frame = _frame(3000, seed=1)
    table = _table(frame)
    # As a shard reads: several chunks, the text dictionary-encoded with different dictionaries.
    pieces = [table.slice(0, 1000), table.slice(1000, 1500), table.slice(2500)]
    chunked = pa.concat_tables(pieces)
    idx = chunked.schema.get_field_index("color")
    encoded = pa.chunked_array([c.dictionary_encode() for c in chunked.column("color").chunks])
    chunked = chunked.set_column(idx, "color", encoded)
    assert chunked.column("x").num_chunks == 3
    got = FittedTransform(RECIPE, FITTED).apply(chunked)
    _check_against_pandas(got, frame, table)


@pytest.mark.parametrize(
    ("codes", "k"),
    [([0, 1, 2, -1, 2], 3), ([0, 0, 0], 1), ([-1, -1], 2), ([], 4), ([1, 0], 2), ([0, -1], 1)],
)
def test_onehot_statistics_from_counts_equal_computed_ones(codes: list[int], k: int) -> None:
    from gpuyard.data.fitted import _encode

    table = pa.table({"c": pa.array([CATS[i] if i >= 0 else "zzz" for i in codes], pa.string())})
    out = _encode(table, "c", {"method": "onehot", "categories": CATS[:k]}, known := {})
    field = out.schema.field("c")
    assert onehot_partial(field, out.num_rows, known["c"]) == partial_stats(out)["c"]


def test_shard_writer_pieces_equal_one_encoded_table() -> None:
    frame = _frame(5000, seed=2)
    table = FittedTransform(RECIPE, FITTED).apply(_table(frame))
    whole = pq.read_table(pa.BufferReader(encode_shard(table)))
    writer = ShardWriter(table.schema, group_rows=700)
    for start, stop in [(0, 10), (10, 1500), (1500, 1500), (1500, 4999), (4999, 5000)]:
        writer.write(table.slice(start, stop - start))
    data = writer.finish()
    pf = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
    assert writer.rows == 5000
    assert [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)] == [700] * 7 + [100]
    assert pf.read().equals(whole) and pf.schema_arrow.equals(whole.schema, check_metadata=True)
    empty = ShardWriter(table.schema, group_rows=10)
    back = pq.read_table(pa.BufferReader(empty.finish()))
    assert back.num_rows == 0 and back.schema.equals(table.schema, check_metadata=True)


def _ingest(tmp_path: Path, frame: pd.DataFrame, monkeypatch: pytest.MonkeyPatch) -> str:
    import gpuyard.data.shards as shards

    src = tmp_path / "src.parquet"
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), src)
    # Small row groups and shards: every shard streams through the transform in many pieces.
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 6000)
    opts = IngestOptions(shard_bytes=60_000, checks=ValidationSpec(nulls="keep", duplicates="keep"))
    return ingest(src, "edge", opts).ref


def test_streamed_transform_equals_the_whole_table_applied(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = _frame(6000, seed=3).drop(columns=["n"])
    ref = _ingest(tmp_path, frame, monkeypatch)
    recipe = Recipe.model_validate(
        {
            "split": {"seed": 1, "kfold": 3},
            "normalize": [{"columns": ["x"], "method": "zscore"}, {"columns": ["flag"], "method": "minmax"}],
            "encode": [{"column": "color", "method": "onehot"}],
        }
    )
    out = transform(ref, recipe, engine="serial")
    src_shards = pq.ParquetFile(out.shard_paths()[0])
    assert len(out.shards) > 1 and src_shards.num_row_groups > 1
    got = out.to_arrow()
    # The recorded transform applied to the input in one go gives the very same columns.
    from gpuyard.data import open_dataset

    raw = open_dataset(ref).to_arrow()
    again = out.transform_for_inference().apply(raw)
    for col in ("x", "flag", "color", "id" if "id" in raw.column_names else "size"):
        assert got.column(col).equals(again.column(col)), col
    # Splits and folds follow the row order, piece after piece.
    from gpuyard.data.split import assign

    codes, folds = assign(len(frame), recipe.split)  # type: ignore[arg-type]
    names = np.array(list(recipe.split.fractions))  # type: ignore[union-attr]
    np.testing.assert_array_equal(got.column("split").to_numpy(zero_copy_only=False), names[codes])
    np.testing.assert_array_equal(got.column("fold").to_numpy(), folds)
    # Statistics merged from the pieces are those of the stored rows.
    _assert_stats_of(out.stats, got)
    # Threads and the process pool run the same pieces: the same shards, the same version.
    assert transform(ref, recipe, engine="thread", workers=2, output="edge-t").version == out.version
    assert transform(ref, recipe, engine="pool", workers=2, output="edge-p").version == out.version


def test_fit_pass_over_pieces_matches_pandas(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = _frame(4000, seed=4)[["x", "color"]]
    ref = _ingest(tmp_path, frame, monkeypatch)
    recipe = Recipe.model_validate(
        {
            "split": {"seed": 2},
            "normalize": [{"columns": ["x"]}],
            "encode": [{"column": "color"}],
        }
    )
    out = transform(ref, recipe, engine="thread", workers=2)
    split = out.to_arrow(["split"]).column("split").to_numpy(zero_copy_only=False)
    train = frame[split == "train"]
    fit = out.fitted["normalize"]["x"]
    assert fit["mean"] == pytest.approx(train["x"].mean(), rel=1e-12)
    assert fit["std"] == pytest.approx(train["x"].std(ddof=0), rel=1e-9)
    # Categories: those seen in train rows (never null, and 'purple' too: it is a train category).
    assert out.fitted["encode"]["color"]["categories"] == sorted(train["color"].dropna().unique())
    assert finish(merge([partial_stats(out.to_arrow(["color"]))]))["color"]["count"] == len(frame)


def test_columns_without_nulls_are_stored_required_and_untouched_ones_keep_their_statistics(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuyard.data.shards as shards
    from gpuyard.data import open_dataset

    rng = np.random.default_rng(6)
    n = 6000
    nan = rng.normal(size=n)
    nan[::50] = np.nan  # NaN, not null: counted as non-finite
    table = pa.table(
        {
            "id": np.arange(n),
            "clean": rng.normal(5, 2, n),
            "nan": nan,
            "nulls": pa.array([None if i % 9 == 0 else float(i) for i in range(n)]),
            "k": rng.integers(0, 50, n),
            "color": rng.choice(CATS, n),
        }
    )
    src = tmp_path / "src.parquet"
    pq.write_table(table, src)
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 6000)
    opts = IngestOptions(shard_bytes=60_000, checks=ValidationSpec(nulls="keep", duplicates="keep"))
    ds = ingest(src, "req", opts)
    stored = ds.to_arrow().schema
    assert [f.name for f in stored if f.nullable] == ["nulls"]
    assert ds.stats["nan"]["nonfinite"] == n // 50 and ds.stats["clean"]["nonfinite"] == 0

    recipe = Recipe.model_validate(
        {"normalize": [{"columns": ["clean", "nan", "nulls", "k"]}], "encode": [{"column": "color"}]}
    )
    out = transform(ds.ref, recipe, engine="thread", workers=2)
    assert len(out.shards) > 1
    got = out.to_arrow()  # every shard has the same schema, so they concatenate
    # Scaled: required when no null and no NaN can come out; one-hot vectors and id: required too.
    assert {f.name for f in got.schema if f.nullable} == {"nan", "nulls"}
    again = out.transform_for_inference().apply(open_dataset(ds.ref).to_arrow())
    for col in got.column_names:
        assert got.column(col).equals(again.column(col)), col
    # The untouched id column's statistics are the input's; they are those of the stored rows.
    assert out.stats["id"] == ds.stats["id"]
    _assert_stats_of(out.stats, got)


def _assert_stats_of(stats: dict[str, Any], table: Any) -> None:
    """``stats`` (a version's, merged from pieces or kept from its input) are those of ``table``'s rows."""
    recomputed = table_stats(table)
    for col, st in stats.items():
        for key, value in st.items():
            if isinstance(value, float):
                assert value == pytest.approx(recomputed[col][key], rel=1e-9, abs=1e-12), (col, key)
            else:
                assert value == recomputed[col][key], (col, key)
