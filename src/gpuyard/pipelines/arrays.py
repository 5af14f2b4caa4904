"""A dataset version's split as ``(X, y)`` arrays: tensor columns flattened, numeric columns as they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError

# Columns a transform adds for bookkeeping: never features.
BOOKKEEPING = ("split", "fold")


def feature_columns(version: Any, label: str) -> list[str]:
    """Feature columns of ``version``: tensors and numbers except the label and split bookkeeping."""
    kinds = version.manifest.get("schema")
    tensors = set(version.tensor_specs())
    cols = []
    for c in version.columns:
        if c == label or c in BOOKKEEPING:
            continue
        stat = version.stats.get(c, {})
        if c in tensors or stat.get("kind") in ("int", "float", "bool"):
            cols.append(c)
    if not cols:
        raise ConfigError(f"dataset {version.ref}: no numeric or tensor feature columns (schema: {kinds})")
    return cols


def split_arrays(
    ref: str, split: str | list[str] | None, label: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(X float32, y)`` of one split (or several) of dataset version ``ref``."""
    from gpuyard.data import open_dataset

    v = open_dataset(ref)
    label = label or v.label_column
    if not label:
        raise ConfigError(f"dataset {v.ref} has no label column")
    cols = feature_columns(v, label)
    parts = split if isinstance(split, list) else [split]
    xs, ys = [], []
    for part in parts:
        arrays = v.to_numpy([*cols, label], split=part)
        n = len(arrays[label])
        xs.append(np.concatenate([arrays[c].reshape(n, -1).astype(np.float32) for c in cols], axis=1))
        ys.append(arrays[label])
    return np.concatenate(xs), np.concatenate(ys)


def write_npz(ref: str, split: list[str], out: Path, label: str | None = None) -> Path:
    """Write splits of ``ref`` as an ``npz:`` dataset (``X``, ``y``) for model management's search."""
    X, y = split_arrays(ref, split, label)
    y = y.astype(np.int64) if y.dtype.kind in "iub" else y.astype(np.float32)
    np.savez(out, X=X, y=y)
    return out
