"""A dataset version as ``(X, y)`` arrays, and split selection in references (``NAME@VERSION#split=a,b``).

This is the one place that turns a dataset version into a feature matrix; model management
(:mod:`gpuyard.models.datasets`) and the pipelines both read through it, so a model sees the same
columns whichever way it was trained.

- Features: tensor columns flattened per row, then int / float / bool columns, in schema order; never
  the label, never the bookkeeping columns ``split`` and ``fold`` a recipe's split step adds. X is
  float32.
- Target: the label column; int64 for classification (an integer or bool label), float32 for
  regression (a float label).
- Selection: ``NAME[@VERSION]#split=train,val`` keeps only the rows of those splits, in the version's
  row order. The recorded version string names the resolved version (``digits@latest#split=train`` ->
  ``digits@3f2a9c01b7de#split=train``), so a run's lineage points at the exact rows it saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.errors import ConfigError
from gpuyard.refs import DatasetRef

# Columns a transform adds for bookkeeping: which rows to use, never something to learn from.
BOOKKEEPING = ("split", "fold")
FEATURE_KINDS = ("tensor", "int", "float", "bool")
LABEL_KINDS = ("int", "float", "bool")
_USUAL = ("train", "val", "validation", "test")


@dataclass(frozen=True)
class ArrayData:
    """A dataset version (or some of its splits) in memory.

    Attributes:
        X: features, float32, shape ``(rows, features)``.
        y: targets, int64 (classification) or float32 (regression).
        version: ``NAME@VERSION`` with the resolved version id, plus ``#split=...`` when selected.
        task: ``classification`` or ``regression``.
        feature_names: the columns behind X, in order (a tensor column counts once).
        label: the label column.
        splits: the selected splits, or None for every row.
        row_splits: each row's split (``train``, ``val``, ``test``...) when the version has a split
            column (its split of record, from a recipe's split step), else None.
    """

    X: np.ndarray
    y: np.ndarray
    version: str
    task: str
    feature_names: tuple[str, ...]
    label: str
    splits: tuple[str, ...] | None
    row_splits: np.ndarray | None = None


def with_splits(ref: str, splits: Sequence[str]) -> str:
    """``ref`` selecting ``splits`` (replacing any selection it had): ``NAME@VERSION#split=a,b``."""
    return str(DatasetRef.parse_base(ref).with_splits(splits))


def available_splits(version: DatasetVersion) -> tuple[str, ...]:
    """The splits of ``version``: the recipe's split sizes, else the values of its ``split`` column."""
    if "split" not in version.columns:
        return ()
    declared = version.manifest.get("splits")
    if isinstance(declared, dict) and declared:
        names = {str(k) for k in declared}
    else:
        values = version.to_arrow(["split"]).column("split").unique()
        if pa.types.is_dictionary(values.type):
            values = values.cast(pa.string())
        names = {str(v) for v in values.to_pylist() if v is not None}
    # Manifests are stored with sorted keys, so the recipe's order is gone: list the usual ones first.
    return tuple(sorted(names, key=lambda n: (_USUAL.index(n) if n in _USUAL else len(_USUAL), n)))


def resolve_selection(ref: str) -> tuple[DatasetVersion, tuple[str, ...] | None, str]:
    """Open the version ``ref`` names and check its split selection against the version's splits.

    Returns:
        (the version, the selected splits or None, the version string to record).

    Raises:
        NotFoundError: no such dataset or version. ConfigError: a selection that is not
            ``split=NAME[,NAME...]``, a repeated or unknown split, or a version without splits; the
            message names ``ref`` and the splits present in the version.
    """
    version = open_dataset(str(DatasetRef.parse_base(ref)))
    if not DatasetRef.has_selection(ref):
        return version, None, version.ref
    available = available_splits(version)
    present = ", ".join(available) or "none: it has no split column (run a recipe with a split step)"
    where = f"splits present in {version.ref}: {present}"
    try:
        splits = DatasetRef.parse(ref).splits or ()
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({where})") from exc
    unknown = [n for n in splits if n not in available]
    if unknown:
        raise ConfigError(f"dataset reference {ref!r}: no split {', '.join(map(repr, unknown))} ({where})")
    return version, splits, str(DatasetRef(version.name, version.version, splits))


def pin(ref: str) -> str:
    """``ref`` with its version resolved: ``digits#split=test`` -> ``digits@3f2a9c01b7de#split=test``."""
    return resolve_selection(ref)[2]


def feature_columns(version: DatasetVersion, label: str) -> list[str]:
    """Feature columns of ``version`` in schema order: tensors and numbers, not the label or bookkeeping.

    Raises:
        ConfigError: the version has no such column.
    """
    kinds = {str(c["name"]): str(c.get("kind")) for c in version.manifest["schema"]}
    cols = [c for c, k in kinds.items() if c != label and c not in BOOKKEEPING and k in FEATURE_KINDS]
    if not cols:
        raise ConfigError(f"dataset {version.ref}: no numeric or tensor feature columns (columns: {kinds})")
    return cols


def _read(version: DatasetVersion, columns: list[str], splits: tuple[str, ...] | None) -> pa.Table:
    """``columns`` of the rows of ``splits`` (all rows when None), plus ``split`` when the version has one."""
    wanted = [*columns, "split"] if "split" in version.columns else columns
    keep = pa.array(list(splits or ()), pa.string())
    tables = []
    for table in version.iter_tables(wanted):
        if splits is not None:
            # One pass per shard for every selected split: rows stay in the version's order.
            split = table.column("split")
            if pa.types.is_dictionary(split.type):
                split = split.cast(pa.string())
            table = table.filter(pc.is_in(split, value_set=keep))
        tables.append(table)
    if not tables:
        raise ConfigError(f"dataset {version.ref} has no shards: there are no rows to load")
    return pa.concat_tables(tables)


def _row_splits(table: pa.Table) -> np.ndarray | None:
    """Each row's split name (object array of str), or None when the table has no split column."""
    if "split" not in table.column_names:
        return None
    col = table.column("split")
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.string())
    values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)
    if col.null_count:
        raise ConfigError(f"split column holds {col.null_count} empty row(s): every row needs its split")
    return values


def _matrix(version: DatasetVersion, table: pa.Table, cols: list[str]) -> np.ndarray:
    """Stack ``cols`` of ``table`` into one float32 matrix (filled in place: no per-column copies kept)."""
    from gpuyard.data.columns import tensor_to_numpy

    specs = version.tensor_specs()
    n = table.num_rows
    widths = [int(np.prod(specs[c].shape)) if c in specs else 1 for c in cols]
    X = np.empty((n, sum(widths)), dtype=np.float32)
    at = 0
    for c, w in zip(cols, widths, strict=True):
        column = table.column(c)
        values = tensor_to_numpy(column, specs[c]) if c in specs else column.to_numpy(zero_copy_only=False)
        X[:, at : at + w] = values.reshape(n, w)
        at += w
    return X


def version_arrays(
    version: DatasetVersion, splits: tuple[str, ...] | None = None, label: str | None = None
) -> ArrayData:
    """``version`` (only the rows of ``splits`` when given) as :class:`ArrayData`.

    Raises:
        ConfigError: no label column, a label that is not a number, nulls in the label, or no features.
    """
    label = label or version.label_column
    if not label:
        raise ConfigError(f"dataset {version.ref} has no label column: it cannot train a model")
    kinds = {str(c["name"]): str(c.get("kind")) for c in version.manifest["schema"]}
    if label not in kinds:
        raise ConfigError(f"dataset {version.ref} has no column {label!r} (has {', '.join(kinds)})")
    if kinds[label] not in LABEL_KINDS:
        raise ConfigError(f"label column {label!r} of {version.ref} is {kinds[label]}; it must be numeric")
    cols = feature_columns(version, label)
    table = _read(version, [*cols, label], splits)
    target = table.column(label)
    if target.null_count:
        raise ConfigError(f"label column {label!r} of {version.ref} has {target.null_count} empty rows")
    task = "regression" if kinds[label] == "float" else "classification"
    y = target.to_numpy(zero_copy_only=False).astype(np.int64 if task == "classification" else np.float32)
    recorded = str(DatasetRef(version.name, version.version, splits))
    X = _matrix(version, table, cols)
    return ArrayData(X, y, recorded, task, tuple(cols), label, splits, _row_splits(table))


def load_arrays(ref: str, label: str | None = None) -> ArrayData:
    """Load ``NAME[@VERSION][#split=a,b]`` as arrays (see the module docstring).

    Raises:
        NotFoundError: no such dataset or version. ConfigError: a bad split selection or a version that
        cannot feed a model (see :func:`version_arrays`).
    """
    version, splits, _recorded = resolve_selection(ref)
    return version_arrays(version, splits, label)


def split_arrays(
    ref: str, split: str | Sequence[str] | None = None, label: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(X, y)`` of ``ref``, restricted to ``split`` (one name or several) when given.

    Raises:
        ConfigError: ``split`` given for a reference that already selects splits.
    """
    if split is not None:
        if DatasetRef.has_selection(ref):
            raise ConfigError(f"dataset reference {ref!r} already selects splits; cannot also take {split!r}")
        ref = with_splits(ref, [split] if isinstance(split, str) else list(split))
    data = load_arrays(ref, label)
    return data.X, data.y
