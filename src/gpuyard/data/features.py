"""Stateless feature steps of a recipe: derived columns, image resize/grayscale, text hashing."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pyarrow as pa

from gpuyard.data import expr
from gpuyard.data.columns import column_kind, tensor_spec, tensor_to_numpy, with_tensor
from gpuyard.data.recipe import Derive, ImageFeatures, TextHash
from gpuyard.errors import ConfigError

_TOKEN = re.compile(r"\w+")
# ITU-R BT.601 luma weights, the ones Pillow's convert("L") uses.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def numeric(col: pa.ChunkedArray) -> np.ndarray:
    """A numeric or boolean column as float64, nulls as NaN."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_boolean(arr.type):
        arr = arr.cast(pa.uint8())
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float64)


def derive(table: pa.Table, step: Derive) -> pa.Table:
    """Add (or replace) the column ``step.name`` computed from ``step.expr``."""
    cols = {n: numeric(table.column(n)) for n in sorted(expr.names(step.expr))}
    with np.errstate(all="ignore"):  # log(0) and x/0 give -inf/inf/nan as NumPy does; not an error
        values = expr.evaluate(step.expr, cols).astype(np.float64)
    if values.ndim == 0:
        values = np.full(table.num_rows, float(values))
    arr = pa.array(values, pa.float64())
    idx = table.schema.get_field_index(step.name)
    return table.set_column(idx, step.name, arr) if idx >= 0 else table.append_column(step.name, arr)


def image_features(table: pa.Table, step: ImageFeatures) -> pa.Table:
    """Grayscale and/or resize a uint8 image tensor column."""
    field = table.schema.field(step.column)
    spec = tensor_spec(field)
    if spec is None or spec.dtype != "uint8" or len(spec.shape) not in (2, 3):
        raise ConfigError(f"recipe image: column {step.column!r} is not a uint8 HxW or HxWxC image column")
    imgs = tensor_to_numpy(table.column(step.column), spec)
    if step.grayscale and imgs.ndim == 4:
        imgs = np.clip(np.rint(imgs[..., :3].astype(np.float32) @ _LUMA), 0, 255).astype(np.uint8)
    if step.resize is not None and tuple(imgs.shape[1:3]) != tuple(step.resize):
        from PIL import Image

        h, w = step.resize
        out = np.empty((len(imgs), h, w, *imgs.shape[3:]), dtype=np.uint8)
        for i, img in enumerate(imgs):
            out[i] = np.asarray(Image.fromarray(img).resize((w, h), Image.Resampling.BILINEAR))
        imgs = out
    return with_tensor(table, step.output or step.column, np.ascontiguousarray(imgs))


def text_hash(table: pa.Table, step: TextHash) -> pa.Table:
    """Token counts of a text column hashed into ``buckets`` (CRC32: stable across processes and hosts)."""
    if column_kind(table.schema.field(step.column)) != "string":
        raise ConfigError(f"recipe text_hash: column {step.column!r} is not text")
    texts = table.column(step.column).to_pylist()
    out = np.zeros((len(texts), step.buckets), dtype=np.float32)
    for i, text in enumerate(texts):
        for token in _TOKEN.findall((text or "").lower()):
            out[i, zlib.crc32(token.encode()) % step.buckets] += 1.0
    if step.output is None:
        table = table.drop_columns([step.column])
    return with_tensor(table, step.output or step.column, out)
