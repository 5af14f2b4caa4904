"""Tensor columns, mergeable statistics, safe expressions and shard integrity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuyard.data import expr
from gpuyard.data.columns import tensor_array, tensor_field, tensor_spec, tensor_to_numpy, with_tensor
from gpuyard.data.shards import encode_shard, read_shard, split_table
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
