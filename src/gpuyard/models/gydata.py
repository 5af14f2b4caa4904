"""A gpuyard dataset version (``NAME@VERSION[#split=a,b]``) as an in-memory :class:`Dataset`.

The arrays come from :func:`gpuyard.data.arrays.load_arrays`, the data layer's one loader (the
pipelines read through it too): tensor columns flattened, numeric columns as they are, the label and
the ``split`` / ``fold`` bookkeeping left out. ``#split=`` keeps only those splits' rows, and the
dataset version recorded in lineage names the resolved version and the splits.
"""

from __future__ import annotations

from typing import Any


def load_gpuyard_dataset(ref: str) -> Any:
    """Load ``NAME[@VERSION][#split=a,b]`` from the dataset catalog as a :class:`Dataset`.

    Raises:
        NotFoundError: no such dataset or version. ConfigError: a bad split selection, no label column,
        or a label that is not a number.
    """
    from gpuyard.data.arrays import load_arrays
    from gpuyard.models.datasets import Dataset

    data = load_arrays(ref)
    return Dataset(X=data.X, y=data.y, version=data.version, task=data.task, feature_names=data.feature_names)
