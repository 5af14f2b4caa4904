"""Data management: versioned sharded datasets, cleaning, transforms, parallel processing and the loader.

Public entry points (the loader lives in :mod:`gpuyard.data.loader`, which imports torch):

- :func:`ingest` turns a CSV/Parquet/JSONL/NumPy file or an image folder into a dataset version.
- :func:`transform` runs a :class:`Recipe` over a version and records a new one.
- :func:`open_dataset` opens ``name`` or ``name@version``; :func:`list_datasets` lists the catalog.
"""

from gpuyard.data.catalog import list_datasets, list_versions
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.fitted import FittedTransform
from gpuyard.data.ingest import IngestOptions, ingest
from gpuyard.data.recipe import Recipe, load_recipe
from gpuyard.data.transforms import transform
from gpuyard.data.validate import ValidationSpec

__all__ = [
    "DatasetVersion",
    "FittedTransform",
    "IngestOptions",
    "Recipe",
    "ValidationSpec",
    "ingest",
    "list_datasets",
    "list_versions",
    "load_recipe",
    "open_dataset",
    "transform",
]
