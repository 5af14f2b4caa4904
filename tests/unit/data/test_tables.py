"""Tensor columns, mergeable statistics, safe expressions and shard integrity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuyard.data import expr
from gpuyard.data.columns import tensor_array, tensor_field, tensor_spec, tensor_to_numpy, with_tensor
from gpuyard.data.shards import (
    ShardWriter,
    _write_options,
    declare_required,
    encode_shard,
    read_shard,
    split_table,
)
from gpuyard.data.stats import finish, merge, partial_stats, table_stats
from gpuyard.errors import ConfigError, IntegrityError

pytestmark = pytest.mark.unit


def test_tensor_column_roundtrips_through_parquet(tmp_path: Path) -> None:
    values = np.random.default_rng(0).integers(0, 255, size=(37, 5, 4, 3), dtype=np.uint8)
    table = with_tensor(pa.table({"y": np.arange(37)}), "x", values)
    path = tmp_path / "s.parquet"
    path.write_bytes(encode_shard(table))
    back = read_shard(path, str(path))
    spec = tensor_spec(back.schema.field("x"))
    assert spec is not None and spec.shape == (5, 4, 3) and spec.dtype == "uint8"
    np.testing.assert_array_equal(tensor_to_numpy(back.column("x"), spec), values)
    # A slice (non-zero offset) decodes to the right rows too.
    np.testing.assert_array_equal(tensor_to_numpy(back.column("x").slice(10, 5), spec), values[10:15])


def test_float_tensor_and_field() -> None:
    arr, spec = tensor_array(np.ones((3, 2), dtype=np.float32))
    assert tensor_spec(tensor_field("e", spec)) == spec
    assert tensor_to_numpy(arr, spec).dtype == np.float32
    with pytest.raises(ConfigError):
        tensor_array(np.ones(3))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6, allow_nan=False)), min_size=1, max_size=60),
    st.integers(1, 59),
)
def test_merged_shard_stats_equal_whole_table_stats(values: list[float | None], cut: int) -> None:
    table = pa.table({"v": pa.array(values, pa.float64()), "c": [str(i % 3) for i in range(len(values))]})
    cut = min(cut, len(values))
    parts = [partial_stats(table.slice(0, cut)), partial_stats(table.slice(cut))]
    merged, whole = finish(merge(parts)), table_stats(table)
    assert merged["v"]["count"] == whole["v"]["count"] == len(values)
    assert merged["v"]["nulls"] == sum(v is None for v in values)
    assert merged["c"]["top"] == whole["c"]["top"]
    present = [v for v in values if v is not None]
    if present:
        assert merged["v"]["min"] == min(present) and merged["v"]["max"] == max(present)
        assert merged["v"]["mean"] == pytest.approx(np.mean(present), rel=1e-9, abs=1e-6)


def test_split_table_hits_target_size() -> None:
    table = pa.table({"x": np.arange(100_000, dtype=np.int64)})  # 800 kB in memory
    pieces = list(split_table(table, 100_000))
    assert len(pieces) == 8 and sum(p.num_rows for p in pieces) == 100_000


def test_expressions_evaluate_and_refuse_code() -> None:
    cols = {"a": np.array([1.0, 4.0]), "b": np.array([2.0, 2.0])}
    np.testing.assert_allclose(expr.evaluate("sqrt(a) * b - 1", cols), [1.0, 3.0])
    assert expr.names("log1p(a) + b ** 2") == {"a", "b"}
    for bad in ("__import__('os').system('true')", "a.real", "[a for a in b]", "'x'", "open('f')"):
        with pytest.raises(ConfigError):
            expr.parse(bad)


def test_truncated_shard_is_reported_by_name(tmp_path: Path) -> None:
    data = encode_shard(pa.table({"x": np.arange(1000)}))
    path = tmp_path / "shard.parquet"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError, match=r"shard\.parquet"):
        read_shard(path, str(path))


def test_flipped_byte_fails_the_page_checksum(tmp_path: Path) -> None:
    data = bytearray(encode_shard(pa.table({"x": np.arange(5000, dtype=np.int64)})))
    data[len(data) // 3] ^= 0xFF  # inside a data page, far from the footer
    path = tmp_path / "flipped.parquet"
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"flipped\.parquet"):
        read_shard(path, str(path))


def _column_meta(data: bytes | pa.Buffer) -> dict[str, tuple[str, tuple[str, ...]]]:
    group = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    return {
        group.column(i).path_in_schema: (group.column(i).compression, group.column(i).encodings)
        for i in range(group.num_columns)
    }


def test_write_settings_follow_each_column() -> None:
    rng = np.random.default_rng(0)
    n = 50_000
    table = pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "noise": rng.normal(size=n),  # random floats: snappy cannot shrink them
            "whole": rng.integers(0, 1000, n).astype(np.float64),  # integer-valued floats: it can
            "text": [f"t{i % 7}" for i in range(n)],
        }
    )
    meta = _column_meta(encode_shard(table))
    assert "DELTA_BINARY_PACKED" in meta["id"][1]  # integers: delta-encoded
    assert meta["noise"][0] == "UNCOMPRESSED" and meta["whole"][0] == "SNAPPY"
    assert "RLE_DICTIONARY" in meta["text"][1]
    back = read_shard(pa.BufferReader(encode_shard(table)), "s")
    assert back.equals(table)


def test_shard_writer_chooses_the_settings_encode_shard_chooses() -> None:
    rng = np.random.default_rng(1)
    n = 20_000
    table = pa.table(
        {"id": np.arange(n), "noise": rng.normal(size=n).astype(np.float32), "k": rng.integers(0, 5, n)}
    )
    writer = ShardWriter(table.schema, group_rows=4096)
    for start in range(0, n, 3000):  # pieces that do not line up with the row groups
        writer.write(table.slice(start, 3000))
    streamed = writer.finish()
    whole_options = pa.BufferOutputStream()
    pq.write_table(
        table, whole_options, row_group_size=4096, **_write_options(table.schema, table.slice(0, 4096))
    )
    assert _column_meta(streamed) == _column_meta(whole_options.getvalue())
    assert pq.read_table(pa.BufferReader(streamed)).equals(table)


def test_declared_required_columns_hold_no_nulls() -> None:
    table = pa.table({"a": [1.0, 2.0], "b": [None, 1.0]})
    out = declare_required(table, ["a"])
    assert not out.schema.field("a").nullable and out.schema.field("b").nullable
    back = read_shard(pa.BufferReader(encode_shard(out)), "s")
    assert back.schema.equals(out.schema) and back.equals(out)
    with pytest.raises(IntegrityError, match="'b'"):
        declare_required(table, ["b"])


def test_float_statistics_count_nan_and_infinities() -> None:
    table = pa.table({"v": pa.array([1.0, np.nan, None, np.inf, 2.0]), "w": [1.0, 2.0, 3.0, 4.0, 5.0]})
    stats = table_stats(table)
    assert stats["v"]["nonfinite"] == 2 and stats["v"]["nulls"] == 1 and stats["v"]["mean"] == 1.5
    assert stats["w"]["nonfinite"] == 0
