"""Tensor columns: fixed-shape arrays (images, embeddings) stored as Parquet fixed-size binary values.

A tensor column is ``fixed_size_binary[nbytes]`` with the dtype and shape in the field's metadata, so a
batch of N samples decodes to one ``(N, *shape)`` NumPy view with no per-row Python work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from gpuyard.errors import ConfigError

TENSOR_KEY = b"gpuyard.tensor"


@dataclass(frozen=True)
class TensorSpec:
    """dtype (NumPy name) and per-row shape of a tensor column."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes per row."""
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, object]:
        """The form stored in manifests."""
        return {"dtype": self.dtype, "shape": list(self.shape)}


def tensor_field(name: str, spec: TensorSpec) -> pa.Field:
    """An Arrow field holding one ``spec``-shaped array per row."""
    meta = json.dumps(spec.to_json()).encode()
    return pa.field(name, pa.binary(spec.nbytes), metadata={TENSOR_KEY: meta})


def tensor_spec(field: pa.Field) -> TensorSpec | None:
    """The tensor spec of ``field``, or None for an ordinary column."""
    meta = field.metadata or {}
    raw = meta.get(TENSOR_KEY)
    if raw is None:
        return None
    doc = json.loads(raw)
    return TensorSpec(dtype=str(doc["dtype"]), shape=tuple(int(x) for x in doc["shape"]))


def tensor_array(values: np.ndarray, *, copy: bool = True) -> tuple[pa.Array, TensorSpec]:
    """Pack ``values`` of shape ``(N, *shape)`` into a fixed-size binary array.

    Args:
        values: the rows.
        copy: copy the bytes (the default); False shares ``values``' buffer with the Arrow array, for
            callers that own ``values`` and never change it afterwards.
    """
    if values.ndim < 2:
        raise ConfigError(f"a tensor column needs at least 2 dimensions, got shape {values.shape}")
    values = np.ascontiguousarray(values)
    spec = TensorSpec(dtype=values.dtype.name, shape=tuple(int(x) for x in values.shape[1:]))
    buf = pa.py_buffer(values.tobytes() if copy else values.reshape(-1).view(np.uint8))
    arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(spec.nbytes), len(values), [None, buf])
    return arr, spec


def tensor_chunks(column: pa.Array | pa.ChunkedArray, spec: TensorSpec) -> list[np.ndarray]:
    """A tensor column as one ``(n, *shape)`` view per Arrow chunk (no copy)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = []
    for chunk in chunks:
        if chunk.null_count:
            raise ConfigError("tensor column has null rows; clean the dataset before loading it as arrays")
        data = chunk.buffers()[1]
        flat = np.frombuffer(data, dtype=np.uint8, count=(chunk.offset + len(chunk)) * spec.nbytes)
        flat = flat[chunk.offset * spec.nbytes :]
        parts.append(flat.view(spec.dtype).reshape((len(chunk), *spec.shape)))
    return parts


def tensor_to_numpy(column: pa.Array | pa.ChunkedArray, spec: TensorSpec) -> np.ndarray:
    """Decode a tensor column into a ``(N, *shape)`` array (a view when the column is one chunk)."""
    parts = tensor_chunks(column, spec)
    if not parts:
        return np.empty((0, *spec.shape), dtype=spec.dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def permuted(parts: list[np.ndarray], perm: np.ndarray) -> np.ndarray:
    """``np.concatenate(parts)[perm]`` in one pass over the rows: each part is written straight to
    its rows' places in the output (the inverse permutation), with no concatenated copy between.

    ``perm`` must be a permutation of ``range(sum(len(p) for p in parts))``; the parts share their
    row shape. Their dtypes may differ (a chunk with nulls decodes as float, another as int): the
    output takes the type ``np.concatenate`` would, so no value is cast down.
    """
    if len(parts) == 1:
        return parts[0][perm]
    n = len(perm)
    where = np.empty(n, dtype=np.intp)
    where[perm] = np.arange(n, dtype=np.intp)
    out = np.empty((n, *parts[0].shape[1:]), dtype=np.result_type(*(p.dtype for p in parts)))
    lo = 0
    for part in parts:
        out[where[lo : lo + len(part)]] = part
        lo += len(part)
    return out


def with_tensor(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    """``table`` with the tensor column ``name`` set to ``values`` (replaced when it exists)."""
    arr, spec = tensor_array(values)
    field = tensor_field(name, spec)
    idx = table.schema.get_field_index(name)
    if idx >= 0:
        return table.set_column(idx, field, arr)
    return table.append_column(field, arr)


def column_kind(field: pa.Field) -> str:
    """One of ``tensor``, ``int``, ``float``, ``bool``, ``string``, ``other``."""
    if tensor_spec(field) is not None:
        return "tensor"
    t = field.type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return "string"
    return "other"


def schema_doc(schema: pa.Schema) -> list[dict[str, object]]:
    """The schema as stored in manifests: name, Arrow type, kind and tensor spec."""
    out: list[dict[str, object]] = []
    for field in schema:
        spec = tensor_spec(field)
        entry: dict[str, object] = {"name": field.name, "type": str(field.type), "kind": column_kind(field)}
        if spec is not None:
            entry["tensor"] = spec.to_json()
        out.append(entry)
    return out
