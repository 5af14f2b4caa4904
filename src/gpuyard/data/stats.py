"""Per-column statistics computed shard by shard and merged, so parallel workers agree with one pass.

A partial is a plain dict (picklable, JSON-able); :func:`finish` turns merged partials into the
figures stored in the manifest (count, nulls, min, max, mean, std, top values).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.columns import column_kind, tensor_spec, tensor_to_numpy

# Beyond this many distinct values a column is treated as free text: only the count is kept.
MAX_DISTINCT = 1000
TOP_VALUES = 20


def partial_stats(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Mergeable statistics of every column of ``table``."""
    return {field.name: _partial(table.column(field.name), field) for field in table.schema}


def _partial(col: pa.ChunkedArray, field: pa.Field) -> dict[str, Any]:
    kind = column_kind(field)
    out: dict[str, Any] = {"kind": kind, "count": len(col), "nulls": col.null_count}
    if kind == "tensor":
        spec = tensor_spec(field)
        assert spec is not None  # kind == "tensor" guarantees it
        arr = tensor_to_numpy(col, spec) if len(col) else np.zeros(0)
        out.update(_tensor_moments(arr.reshape(-1)))
        out["shape"] = list(spec.shape)
        out["dtype"] = spec.dtype
    elif kind in ("int", "bool"):
        valid = col if col.null_count == 0 else pc.drop_null(col)
        ints = np.asarray(valid.to_numpy(zero_copy_only=False)) if len(valid) else np.zeros(0, np.int64)
        if ints.dtype == bool:
            ints = ints.view(np.uint8)
        if ints.size and int(ints.min()) >= 0 and int(ints.max()) <= 1 << 16:
            # Small non-negative integers (labels, flags, codes): one bincount gives moments and counts.
            found = np.bincount(ints)
            v = np.arange(len(found), dtype=np.float64)
            out.update(n=int(ints.size), sum=float(v @ found), sumsq=float((v * v) @ found))
            out.update(min=float(ints.min()), max=float(ints.max()))
            nz = np.flatnonzero(found)
            if len(nz) > MAX_DISTINCT:
                out["values"], out["many_values"] = {}, True
            else:
                name = (lambda x: str(bool(x))) if kind == "bool" else (lambda x: str(int(x)))
                out["values"] = {name(x): int(found[x]) for x in nz}
            return out
        out.update(_moments(ints))
    elif kind == "float":
        valid = col if col.null_count == 0 else pc.drop_null(col)
        nums = np.asarray(valid.to_numpy(zero_copy_only=False)) if len(valid) else np.zeros(0)
        finite = np.isfinite(nums)
        out.update(_moments(nums if finite.all() else nums[finite]))
    if kind in ("string", "int", "bool"):
        values, many = _value_counts(col)
        out["values"] = values
        if many:
            out["many_values"] = True
    return out


def _value_counts(col: pa.ChunkedArray) -> tuple[dict[str, int], bool]:
    valid = pc.drop_null(col).combine_chunks() if len(col) else pa.array([], col.type)
    # A sample first: an id-like column shows more than MAX_DISTINCT values early, and we stop there.
    if (
        len(valid) > 20 * MAX_DISTINCT
        and len(pc.value_counts(valid.slice(0, 10 * MAX_DISTINCT))) > MAX_DISTINCT
    ):
        return {}, True
    counts = pc.value_counts(valid) if len(valid) else []
    values: dict[str, int] = {}
    for item in counts:
        values[str(item["values"].as_py())] = int(item["counts"].as_py())
        if len(values) > MAX_DISTINCT:
            return {}, True
    return values, False


# Squares of these small integer types fit exactly in the wider type named here.
_SQUARE_TYPES = {"uint8": pa.uint16(), "int8": pa.int16(), "uint16": pa.uint32(), "int16": pa.int32()}


def _tensor_moments(values: np.ndarray) -> dict[str, Any]:
    """Moments of a flat tensor column: exact integer sums for 8- and 16-bit values, else float64.

    Images and one-hot vectors are uint8; converting every value to float64 first (8 bytes each) cost
    more than the rest of a transform's statistics together. Arrow sums them as they are, exactly.
    """
    square = _SQUARE_TYPES.get(values.dtype.name)
    if square is None or values.size == 0:
        return _moments(values)
    arr = pa.array(values)  # zero-copy view of the NumPy buffer
    wide = arr.cast(square)
    lo_hi = pc.min_max(arr)
    return {
        "n": int(values.size),
        "sum": float(pc.sum(arr).as_py()),
        "sumsq": float(pc.sum(pc.multiply(wide, wide)).as_py()),
        "min": float(lo_hi["min"].as_py()),
        "max": float(lo_hi["max"].as_py()),
    }


def _moments(values: np.ndarray) -> dict[str, Any]:
    """Count, sum, sum of squares, min and max of a flat numeric array, accumulated in float64."""
    if values.size == 0:
        return {"n": 0, "sum": 0.0, "sumsq": 0.0, "min": None, "max": None}
    # Accumulate in float64 without a float64 copy of the column; einsum rather than np.dot, which
    # hands large vectors to multi-threaded BLAS (threads that only contend with pool workers here).
    return {
        "n": int(values.size),
        "sum": float(values.sum(dtype=np.float64)),
        "sumsq": float(np.einsum("i,i->", values, values, dtype=np.float64)),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def merge(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Merge partial statistics of the same columns (from several shards)."""
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, p in part.items():
            acc = out.get(name)
            if acc is None:
                out[name] = {**p, "values": dict(p["values"])} if "values" in p else dict(p)
                continue
            acc["count"] += p["count"]
            acc["nulls"] += p["nulls"]
            if "n" in p:
                acc["n"] += p["n"]
                acc["sum"] += p["sum"]
                acc["sumsq"] += p["sumsq"]
                acc["min"] = _opt(min, acc["min"], p["min"])
                acc["max"] = _opt(max, acc["max"], p["max"])
            if "values" in p and not acc.get("many_values"):
                if p.get("many_values"):
                    acc["values"], acc["many_values"] = {}, True
                else:
                    merged = Counter(acc["values"])
                    merged.update(p["values"])
                    acc["values"] = dict(merged) if len(merged) <= MAX_DISTINCT else {}
                    acc["many_values"] = len(merged) > MAX_DISTINCT
    return out


def _opt(fn: Any, a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return float(fn(a, b))


def finish(merged: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The manifest form: count, nulls, min, max, mean, std (population), distinct and top values.

    Float columns also count their values that are neither null nor finite (``nonfinite``: NaN and
    infinities, which the moments leave out).
    """
    out: dict[str, dict[str, Any]] = {}
    for name, p in merged.items():
        doc: dict[str, Any] = {"kind": p["kind"], "count": p["count"], "nulls": p["nulls"]}
        if "n" in p:
            n = p["n"]
            mean = p["sum"] / n if n else None
            var = max(0.0, p["sumsq"] / n - mean * mean) if n and mean is not None else None
            doc.update(min=p["min"], max=p["max"], mean=mean, std=math.sqrt(var) if var is not None else None)
            if p["kind"] == "float":  # NaN and infinities: left out of the moments, counted here
                doc["nonfinite"] = p["count"] - p["nulls"] - n
        if "shape" in p:
            doc.update(shape=p["shape"], dtype=p["dtype"])
        if "values" in p:
            if p.get("many_values"):
                doc["distinct"] = f">{MAX_DISTINCT}"
            else:
                doc["distinct"] = len(p["values"])
                top = sorted(p["values"].items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_VALUES]
                doc["top"] = dict(top)
        out[name] = doc
    return out


def table_stats(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Finished statistics of one table."""
    return finish(merge([partial_stats(table)]))
