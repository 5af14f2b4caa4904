"""A recipe with the statistics fitted on a version's train split: the transform applied to new rows.

:func:`gpuyard.data.transforms.transform` fits and records it in the output version's manifest;
:meth:`FittedTransform.from_manifest` reads it back, so inference transforms rows exactly as the
training data was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.columns import TensorSpec, tensor_array, tensor_field
from gpuyard.data.features import derive, image_features, text_hash
from gpuyard.data.recipe import Recipe
from gpuyard.data.shards import FEW_VALUES_KEY


@dataclass(frozen=True)
class FittedTransform:
    """A recipe plus the statistics fitted on its train split.

    Attributes:
        recipe: the recipe.
        fitted: ``{"normalize": {col: {...}}, "encode": {col: {"method", "categories"}}}``.
    """

    recipe: Recipe
    fitted: dict[str, Any]

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> FittedTransform:
        """The transform recorded in a version's manifest (an ingested version gives the identity)."""
        recipe = (
            Recipe.model_validate(manifest.get("recipe") or {})
            if manifest["kind"] == "transform"
            else Recipe()
        )
        return cls(recipe=recipe, fitted=dict(manifest.get("fitted") or {}))

    def features(self, table: pa.Table) -> pa.Table:
        """The stateless steps: derived columns, image features, text hashing."""
        for d in self.recipe.derive:
            table = derive(table, d)
        for im in self.recipe.image:
            table = image_features(table, im)
        for th in self.recipe.text_hash:
            table = text_hash(table, th)
        return table

    def finish(self, table: pa.Table) -> pa.Table:
        """The fitted steps (normalize, encode) and ``drop``."""
        return self.finish_counted(table)[0]

    def finish_counted(self, table: pa.Table) -> tuple[pa.Table, dict[str, int]]:
        """:meth:`finish`, and for each one-hot column the number of rows with a known category.

        The count is all the one-hot column's statistics need (each such row holds one 1), so a
        transform records them without reading the vectors again.
        """
        known: dict[str, int] = {}
        for col, p in self.fitted.get("normalize", {}).items():
            if col in table.column_names:
                table = table.set_column(table.schema.get_field_index(col), col, _scale(table.column(col), p))
        for col, p in self.fitted.get("encode", {}).items():
            if col in table.column_names:
                table = _encode(table, col, p, known)
        gone = [c for c in self.recipe.drop if c in table.column_names]
        for c in gone:
            known.pop(c, None)
        return (table.drop_columns(gone) if gone else table), known

    def apply(self, table: pa.Table) -> pa.Table:
        """Transform new rows exactly as the training data was (no split, no augmentation)."""
        return self.finish(self.features(table))


def _arrow_empty(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, pa.Buffer]:
    """An uninitialised NumPy array living in a buffer from Arrow's memory pool, and that buffer.

    Arrow's allocator keeps freed memory for the next piece; a fresh NumPy array of a few MiB is a
    new mapping whose every page faults in again (measured: most of a transform's page faults).
    """
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    buf = pa.allocate_buffer(nbytes)
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dt).reshape(shape), buf


# Rows per slice when scaling: a float64 slice this long stays in the CPU cache between its operations.
_SLICE = 1 << 15


def _float_chunks(col: pa.ChunkedArray | pa.Array) -> list[np.ndarray]:
    """Each chunk of a numeric or boolean column as float64 (nulls as NaN), without joining the chunks."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out = []
    for chunk in chunks:
        if pa.types.is_null(chunk.type):  # only nulls (a raw record with no value): all missing
            out.append(np.full(len(chunk), np.nan))
            continue
        if pa.types.is_boolean(chunk.type):
            chunk = chunk.cast(pa.uint8())
        # No nulls: a zero-copy view of Arrow's buffer (ints are converted, as np.asarray would).
        values = chunk.to_numpy(zero_copy_only=False)
        out.append(np.asarray(values, dtype=np.float64))
    return out


def _scale(col: pa.ChunkedArray, p: dict[str, Any]) -> pa.Array:
    """``(x - shift) / scale`` as float32, computed in float64; nulls (and NaN) stay null.

    Elementwise the same operations as ``((x - shift) * (1 / scale)).astype(float32)`` over the whole
    column, done in cache-sized slices of each chunk straight into the float32 result: no joined copy
    of the column and no float64 copy of it either.
    """
    if p["method"] == "zscore":
        shift, scale = p["mean"], p["std"]
    else:
        shift, scale = p["min"], p["max"] - p["min"]
    inv = 1.0 / (scale if scale else 1.0)  # a constant column maps to 0, not to NaN
    out, buf = _arrow_empty((len(col),), np.float32)
    tmp = np.empty(min(_SLICE, max(len(col), 1)), dtype=np.float64)
    start = 0
    for values in _float_chunks(col):
        for i in range(0, len(values), _SLICE):
            part = values[i : i + _SLICE]
            t = tmp[: len(part)]
            np.subtract(part, shift, out=t)
            # The product is computed in float64 and rounded once into the float32 result, as
            # ``t *= inv`` then a copy would: one pass over the slice fewer.
            np.multiply(t, inv, out=out[start + i : start + i + len(part)], casting="same_kind")
        start += len(values)
    nan = np.isnan(out)
    if nan.any():
        return pa.array(out, pa.float32(), mask=nan)
    return pa.Array.from_buffers(pa.float32(), len(out), [None, buf])


def _codes(column: pa.ChunkedArray | pa.Array, categories: list[Any]) -> np.ndarray:
    """Category index of every row (-1 for unknown or null)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if pa.types.is_null(column.type) or not categories:  # only nulls, or nothing to find
        return np.full(len(column), -1, dtype=np.int32)
    if pa.types.is_dictionary(column.type):
        # Shards store text dictionary-encoded: look up the few dictionary entries, then index.
        out = np.empty(len(column), dtype=np.int32)
        start = 0
        for chunk in chunks:
            lookup = _codes(chunk.dictionary, categories)
            stop = start + len(chunk)
            if chunk.null_count:
                nulls = np.asarray(chunk.is_null().to_numpy(zero_copy_only=False), dtype=bool)
                idx = chunk.indices.fill_null(0).to_numpy(zero_copy_only=False)
                np.take(lookup, idx, out=out[start:stop])
                out[start:stop][nulls] = -1
            else:
                np.take(lookup, chunk.indices.to_numpy(zero_copy_only=False), out=out[start:stop])
            start = stop
        return out
    cats = pa.array(categories).cast(column.type)
    found = pc.fill_null(pc.index_in(column, value_set=cats), -1)
    return np.asarray(found.to_numpy(zero_copy_only=False), dtype=np.int32)


def _onehot(codes: np.ndarray, k: int) -> tuple[np.ndarray, pa.Buffer]:
    """``(N, k)`` uint8 rows with a 1 at each row's code, a row of zeros for -1 (unknown or null);
    and the Arrow buffer holding them.

    Zeros, then a 1 stored at each known row's position, in a buffer from Arrow's pool. Arrow's own
    ``take`` of the k + 1 rows is faster than NumPy's ``take`` of them
    on memory already touched (0.30 against 0.56 ms per 178K rows), but its results are fresh
    allocations whose pages fault in again piece after piece: 12,000 page faults per 3M rows in the
    transform, whose fitted steps then took 15-20 ms more CPU, not less (see docs/data.md).
    """
    out, buf = _arrow_empty((len(codes), k), np.uint8)
    out[...] = 0  # a row of zeros stays for an unknown code
    flat = out.reshape(-1)
    pos = np.arange(0, len(codes) * k, k, dtype=np.intp)
    pos += codes
    known = codes >= 0
    # One store per row into the zeroed buffer: a gather of k-byte rows copies each row byte by byte
    # (1.8 against 1.2 ms per 178K rows of 20 categories).
    flat[pos if known.all() else pos[known]] = 1
    return out, buf


def _encode(table: pa.Table, col: str, p: dict[str, Any], known: dict[str, int] | None = None) -> pa.Table:
    codes = _codes(table.column(col), p["categories"])
    idx = table.schema.get_field_index(col)
    if p["method"] == "ordinal":  # never null: -1 for unknown
        return table.set_column(idx, pa.field(col, pa.int32(), nullable=False), pa.array(codes))
    # One uint8 vector per row in a single tensor column: Parquet has no 8-bit integers, so k separate
    # flag columns would be stored as k int32 values per row; the vector is k bytes, and model-ready.
    k = len(p["categories"])
    if known is not None:
        known[col] = int(np.count_nonzero(codes >= 0))
    if k:
        _, buf = _onehot(codes, k)
        arr: pa.Array = pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), len(codes), [None, buf])
        spec = TensorSpec(dtype="uint8", shape=(k,))
    else:  # no category was seen: vectors of no values
        arr, spec = tensor_array(np.zeros((len(codes), 0), dtype=np.uint8))
    field = tensor_field(col, spec).with_nullable(False)  # never null: zeros for unknown
    field = field.with_metadata({**(field.metadata or {}), FEW_VALUES_KEY: b"1"})
    return table.set_column(idx, field, arr)
