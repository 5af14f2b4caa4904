"""The pipelines' view of a dataset version as arrays: a re-export of :mod:`gpuyard.data.arrays`.

One loader serves model management and the pipelines; this module keeps the names the stages and
``torchglue`` import.
"""

from gpuyard.data.arrays import (
    BOOKKEEPING,
    feature_columns,
    load_arrays,
    pin,
    split_arrays,
    with_splits,
)

__all__ = ["BOOKKEEPING", "feature_columns", "load_arrays", "pin", "split_arrays", "with_splits"]
