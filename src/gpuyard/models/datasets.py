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
    return Dataset(X=data.X, y=data.y, version=data.version, task=data.task, feature_names=data.feature_names)


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
