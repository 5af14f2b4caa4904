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

from gpuyard.data.columns import tensor_array, tensor_field
from gpuyard.data.features import derive, image_features, numeric, text_hash
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
        for col, p in self.fitted.get("normalize", {}).items():
            if col in table.column_names:
                table = table.set_column(table.schema.get_field_index(col), col, _scale(table.column(col), p))
        for col, p in self.fitted.get("encode", {}).items():
            if col in table.column_names:
                table = _encode(table, col, p)
        gone = [c for c in self.recipe.drop if c in table.column_names]
        return table.drop_columns(gone) if gone else table

    def apply(self, table: pa.Table) -> pa.Table:
        """Transform new rows exactly as the training data was (no split, no augmentation)."""
        return self.finish(self.features(table))


def _scale(col: pa.ChunkedArray, p: dict[str, Any]) -> pa.Array:
    values = numeric(col)
    if p["method"] == "zscore":
        shift, scale = p["mean"], p["std"]
    else:
        shift, scale = p["min"], p["max"] - p["min"]
    out = values - shift
    out *= 1.0 / (scale if scale else 1.0)  # a constant column maps to 0, not to NaN
    return pa.array(out.astype(np.float32), pa.float32(), from_pandas=True)


def _codes(column: pa.ChunkedArray, categories: list[Any]) -> np.ndarray:
    """Category index of every row (-1 for unknown or null)."""
    if pa.types.is_dictionary(column.type):
        # Shards store text dictionary-encoded: look up the few dictionary entries, then index.
        parts = []
        for chunk in column.chunks:
            lookup = _codes(pa.chunked_array([chunk.dictionary]), categories)
            idx = chunk.indices.to_numpy(zero_copy_only=False)
            nulls = np.asarray(chunk.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            parts.append(np.where(nulls, -1, lookup[np.where(nulls, 0, idx).astype(np.int64)]))
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    cats = pa.array(categories).cast(column.type)
    found = pc.fill_null(pc.index_in(column, value_set=cats), -1)
    return np.asarray(found.to_numpy(zero_copy_only=False), dtype=np.int32)


def _encode(table: pa.Table, col: str, p: dict[str, Any]) -> pa.Table:
    codes = _codes(table.column(col), p["categories"])
    idx = table.schema.get_field_index(col)
    if p["method"] == "ordinal":
        return table.set_column(idx, col, pa.array(codes))
    # One uint8 vector per row in a single tensor column: Parquet has no 8-bit integers, so k separate
    # flag columns would be stored as k int32 values per row; the vector is k bytes, and model-ready.
    onehot = np.zeros((len(codes), len(p["categories"])), dtype=np.uint8)
    known = np.flatnonzero(codes >= 0)
    onehot[known, codes[known]] = 1
    arr, spec = tensor_array(onehot, copy=False)  # onehot is ours alone: share, do not copy
    field = tensor_field(col, spec)
    field = field.with_metadata({**(field.metadata or {}), FEW_VALUES_KEY: b"1"})
    return table.set_column(idx, field, arr)
