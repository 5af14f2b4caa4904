"""A gpuyard dataset version (``NAME@VERSION``) as in-memory arrays for evaluation and search.

Reads the version's manifest and Parquet shards through ``gpuyard.data``'s catalog and shard readers
(checksums verified there), then stacks the feature columns into ``X`` and the label column into ``y``.
Tensor columns (images) are flattened per row, numeric columns are taken as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuyard.errors import ConfigError


def load_gpuyard_dataset(ref: str) -> Any:
    """Load ``NAME[@VERSION]`` from the dataset catalog as a :class:`gpuyard.models.datasets.Dataset`.

    Raises:
        NotFoundError: no such dataset or version. ConfigError: no label column, or a column that is
        neither numeric nor a tensor.
    """
    import pyarrow as pa

    from gpuyard.data.catalog import load_manifest, resolve
    from gpuyard.data.columns import tensor_spec, tensor_to_numpy
    from gpuyard.data.shards import read_shard
    from gpuyard.models.datasets import Dataset
    from gpuyard.store import get_artifacts

    row = resolve(ref)
    manifest = load_manifest(row)
    label = manifest.get("label_column")
    if not label:
        raise ConfigError(f"dataset {row.dataset}@{row.version} has no label column: it cannot train a model")
    artifacts = get_artifacts()
    tables = []
    for shard in manifest["shards"]:
        with artifacts.open(shard["key"]) as fh:
            tables.append(read_shard(fh, shard["key"]))
    table = pa.concat_tables(tables)
    # A recipe's split step adds "split" (text, skipped below) and, with k-fold, an integer "fold":
    # bookkeeping that says which rows to use, never a feature a model should learn from.
    bookkeeping = {"fold"} if "split" in table.column_names else set()
    features: list[np.ndarray] = []
    names: list[str] = []
    y: np.ndarray | None = None
    for fld in table.schema:
        if fld.name in bookkeeping:
            continue
        column = table.column(fld.name)
        spec = tensor_spec(fld)
        if spec is not None:
            values = tensor_to_numpy(column, spec).reshape(table.num_rows, -1)
        elif pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type) or pa.types.is_boolean(fld.type):
            values = column.to_numpy(zero_copy_only=False).reshape(table.num_rows, -1)
        else:
            if fld.name == label:
                raise ConfigError(f"label column {label!r} has type {fld.type}; it must be numeric")
            continue  # ids, text and other columns a plain model cannot read
        if fld.name == label:
            y = values.reshape(-1)
        else:
            features.append(values.astype(np.float32))
            names.append(fld.name)
    if y is None or not features:
        raise ConfigError(
            f"dataset {row.dataset}@{row.version}: needs label column {label!r} and numeric features"
        )
    task = "classification" if np.issubdtype(y.dtype, np.integer) or y.dtype == bool else "regression"
    return Dataset(
        X=np.concatenate(features, axis=1),
        y=y.astype(np.int64) if task == "classification" else y.astype(np.float32),
        version=f"{row.dataset}@{row.version}",
        task=task,
        feature_names=tuple(names),
    )
