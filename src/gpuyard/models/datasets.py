"""In-memory datasets for evaluation, search and cross-validation, and their reproducible splits.

A dataset reference is a string recorded as the run's dataset version:

- ``sklearn:digits`` / ``sklearn:breast_cancer`` / ``sklearn:diabetes`` / ``sklearn:iris`` /
  ``sklearn:wine``: scikit-learn's bundled data (offline); the version is the scikit-learn release.
- ``npz:PATH``: a NumPy ``.npz`` file with arrays ``X`` and ``y`` (loaded with ``allow_pickle=False``);
  the version is the first 12 hex digits of the file's SHA-256.
- ``NAME@VERSION``: a version of a gpuyard dataset (``gpuyard.data``), read by
  :func:`gpuyard.data.arrays.load_arrays`; ``NAME`` or ``NAME@latest`` is its newest version. The
  recorded version is the resolved one.
- ``NAME@VERSION#split=train,val``: only the rows of those splits of the version (a recipe's split
  step makes them), in the version's row order; recorded as ``NAME@<version id>#split=train,val``.

A fit, search, cross-validation or retrain first pins its reference (:func:`pin_dataset`): caches are
keyed on, and lineage records, ``NAME@<version id>[#split=...]``, never ``latest``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.refs import DatasetRef

SKLEARN_SETS = {
    "digits": ("load_digits", "classification"),
    "breast_cancer": ("load_breast_cancer", "classification"),
    "iris": ("load_iris", "classification"),
    "wine": ("load_wine", "classification"),
    "diabetes": ("load_diabetes", "regression"),
}


@dataclass(frozen=True)
class Dataset:
    """Features and targets in memory, with the version string recorded in lineage."""

    X: np.ndarray
    y: np.ndarray
    version: str
    task: str
    feature_names: tuple[str, ...] = ()
    # Each row's split of record (a gpuyard version's ``split`` column, from its recipe), else None.
    row_splits: np.ndarray | None = None

    @property
    def has_split_of_record(self) -> bool:
        """Whether the rows come with their split (nothing re-splits them: :func:`split_of_record`)."""
        return self.row_splits is not None


@dataclass(frozen=True)
class SplitSpec:
    """How a dataset is cut into train / validation / test (the held-out test never feeds selection).

    Attributes:
        val: fraction for validation (model selection, pruning, early stopping).
        test: fraction held out for the final test and for promotion decisions.
        seed: random seed of the split.
        stratify: keep class proportions in each part (classification only).
    """

    val: float = 0.2
    test: float = 0.2
    seed: int = 0
    stratify: bool = True

    def __post_init__(self) -> None:
        if not (0 <= self.val < 1 and 0 < self.test < 1 and self.val + self.test < 1):
            raise ConfigError(
                f"split fractions val={self.val} test={self.test} must be in [0,1) and sum below 1"
            )


@dataclass(frozen=True)
class Splits:
    """The three parts of a dataset (validation may be empty when ``val`` is 0)."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_val: np.ndarray
    y_val: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray


def _sklearn(name: str) -> Dataset:
    import sklearn
    import sklearn.datasets as skd

    if name not in SKLEARN_SETS:
        raise NotFoundError(f"sklearn dataset {name!r} unknown: use one of {', '.join(sorted(SKLEARN_SETS))}")
    loader, task = SKLEARN_SETS[name]
    bunch: Any = getattr(skd, loader)()
    X = np.asarray(bunch.data, dtype=np.float32)
    y = np.asarray(bunch.target, dtype=np.int64 if task == "classification" else np.float32)
    names = tuple(str(n) for n in getattr(bunch, "feature_names", ()))
    return Dataset(X=X, y=y, version=f"sklearn:{name}@{sklearn.__version__}", task=task, feature_names=names)


def _npz(path: str) -> Dataset:
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"dataset file {path!r} not found")
    digest = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    try:
        with np.load(p, allow_pickle=False) as data:
            if "X" not in data or "y" not in data:
                raise ConfigError(
                    f"{path}: an npz dataset needs arrays 'X' and 'y' (found {', '.join(data.files)})"
                )
            X, y = np.asarray(data["X"]), np.asarray(data["y"])
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable .npz file without pickled objects ({exc})") from exc
    if len(X) != len(y):
        raise ConfigError(f"{path}: X has {len(X)} rows but y has {len(y)}")
    task = "classification" if np.issubdtype(y.dtype, np.integer) else "regression"
    return Dataset(X=X.astype(np.float32), y=y, version=f"npz:{p.name}@{digest}", task=task)


def load_dataset(ref: str) -> Dataset:
    """Load the dataset ``ref`` (see the module docstring for the forms).

    Raises:
        ConfigError: an unrecognised reference. NotFoundError: no such dataset.
    """
    if ref.startswith("sklearn:"):
        if "#" in ref:
            # Only a gpuyard version carries a split column; the spec's `split:` cuts these sets.
            raise ConfigError(
                f"dataset reference {ref!r}: #split= selects splits of a gpuyard dataset version"
                " (NAME@VERSION#split=...); scikit-learn sets have no splits"
            )
        return _sklearn(ref.split(":", 1)[1].split("@", 1)[0])
    if ref.startswith("npz:"):
        return _npz(ref.split(":", 1)[1])  # a path: '#' is part of the file name there
    if _catalog_ref(ref):
        return _gpuyard(ref)
    raise ConfigError(_BAD_REF.format(ref=ref))


def _gpuyard(ref: str) -> Dataset:
    """A gpuyard dataset version as arrays: the data layer's one loader, which the pipelines use too."""
    from gpuyard.data.arrays import load_arrays

    data = load_arrays(ref)
    return Dataset(
        X=data.X,
        y=data.y,
        version=data.version,
        task=data.task,
        feature_names=data.feature_names,
        row_splits=data.row_splits,
    )


_BAD_REF = "dataset reference {ref!r}: use sklearn:NAME, npz:PATH, NAME@VERSION or NAME@VERSION#split=a,b"


def _catalog_ref(ref: str) -> bool:
    """Whether ``ref`` (not sklearn: or npz:) has the shape of a gpuyard catalog reference."""
    try:
        DatasetRef.parse_base(ref)
    except ConfigError:
        return False
    return True


def pin_dataset(ref: str) -> str:
    """``ref`` naming one version that never changes, for caches and lineage.

    A gpuyard dataset's ``NAME``, ``NAME@latest`` or version prefix resolves to ``NAME@<version id>``,
    its ``#split=`` selection kept (``digits@latest#split=train`` -> ``digits@3f2a9c01b7de#split=train``):
    a later ingest cannot change what the pinned reference names. ``sklearn:`` and ``npz:`` references
    come back as they are (the file behind ``npz:`` is read, and versioned, by content when loaded).

    Raises:
        NotFoundError: no such dataset or version. ConfigError: a bad reference or split selection.
    """
    if ref.startswith(("sklearn:", "npz:")):
        return ref
    if not _catalog_ref(ref):
        raise ConfigError(_BAD_REF.format(ref=ref))
    from gpuyard.data.arrays import pin

    return pin(ref)


def split_dataset(ds: Dataset, spec: SplitSpec) -> Splits:
    """Cut ``ds`` into train / validation / test, reproducibly for a given ``spec.seed``."""
    from sklearn.model_selection import train_test_split

    strat = ds.y if spec.stratify and ds.task == "classification" else None
    X_rest, X_test, y_rest, y_test = train_test_split(
        ds.X, ds.y, test_size=spec.test, random_state=spec.seed, stratify=strat
    )
    if spec.val == 0:
        empty_x, empty_y = X_rest[:0], y_rest[:0]
        return Splits(X_rest, y_rest, empty_x, empty_y, X_test, y_test)
    strat_rest = y_rest if strat is not None else None
    X_train, X_val, y_train, y_val = train_test_split(
        X_rest, y_rest, test_size=spec.val / (1 - spec.test), random_state=spec.seed, stratify=strat_rest
    )
    return Splits(X_train, y_train, X_val, y_val, X_test, y_test)


# Names a recipe's split step may give the validation rows.
VALIDATION_NAMES = ("val", "validation")


def split_counts(ds: Dataset) -> dict[str, int]:
    """Rows per split of record (empty when ``ds`` has none)."""
    if ds.row_splits is None:
        return {}
    names, counts = np.unique(ds.row_splits.astype(str), return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts, strict=True)}


def split_of_record(ds: Dataset, spec: SplitSpec | None = None) -> Splits:
    """The train / validation / test rows of ``ds`` as its version's split names them (rows in order).

    The recipe fitted its statistics (z-score, categories) on the ``train`` rows, so these rows, not a
    new random cut, are what a fit trains and tests on: a re-split would put rows whose statistics
    shaped the features into the test part, and test rows into training. Rows of any other split
    name (a recipe's ``holdout``...) are used for nothing. When there are no validation rows (a
    reference selecting ``#split=train``), ``spec.val`` of the train rows (seeded, stratified as
    ``spec`` says) become the validation part: train rows only, never a test row.

    Raises:
        ConfigError: ``ds`` has no split of record, or none of its rows is ``train``.
    """
    if ds.row_splits is None:
        raise ConfigError(f"{ds.version} has no split column: it has no split of record")
    names = ds.row_splits.astype(str)
    train = names == "train"
    if not train.any():
        present = ", ".join(split_counts(ds)) or "none"
        raise ConfigError(
            f"{ds.version} has no 'train' rows (splits present: {present}): a fit needs the train split"
        )
    val = np.isin(names, VALIDATION_NAMES)
    test = names == "test"
    if not val.any() and spec is not None and spec.val > 0 and train.sum() >= 4:
        from sklearn.model_selection import train_test_split

        idx = np.flatnonzero(train)
        strat = ds.y[idx] if spec.stratify and ds.task == "classification" else None
        try:
            kept, carved = train_test_split(idx, test_size=spec.val, random_state=spec.seed, stratify=strat)
        except ValueError:  # a class too rare to stratify: an unstratified cut
            kept, carved = train_test_split(idx, test_size=spec.val, random_state=spec.seed)
        train = np.zeros_like(train)
        train[kept] = True
        val = np.zeros_like(val)
        val[carved] = True
    return Splits(ds.X[train], ds.y[train], ds.X[val], ds.y[val], ds.X[test], ds.y[test])


def train_folds(ds: Dataset, folds: int, seed: int, stratify: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """k-fold (train indices, validation indices) over the ``train`` rows of ``ds``'s split of record.

    Indices are into ``ds.X``; validation and test rows of the split of record are in no fold.
    """
    from sklearn.model_selection import KFold, StratifiedKFold

    if ds.row_splits is None:
        raise ConfigError(f"{ds.version} has no split column: it has no split of record")
    idx = np.flatnonzero(ds.row_splits.astype(str) == "train")
    if len(idx) < folds:
        raise ConfigError(f"{ds.version}: {len(idx)} train row(s) cannot make {folds} folds")
    y = ds.y[idx]
    kf = (StratifiedKFold if stratify and ds.task == "classification" else KFold)(
        n_splits=folds, shuffle=True, random_state=seed
    )
    return [(idx[a], idx[b]) for a, b in kf.split(idx, y)]
