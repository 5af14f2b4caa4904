"""Seeded splits (random, stratified, by time) and k-fold assignments for cross-validation.

Assignments are computed once over the whole version (they need a global view: class counts, time
order) and handed to the shard workers as small integer arrays, so the pool and Ray agree exactly.
"""

from __future__ import annotations

import numpy as np

from gpuyard.data.recipe import Split


def _counts(n: int, fractions: list[float]) -> list[int]:
    # Largest-remainder rounding: counts sum to n exactly and follow the fractions as closely as possible.
    raw = np.asarray(fractions) * n
    base = np.floor(raw).astype(int)
    order = np.argsort(-(raw - base), kind="stable")
    base[order[: n - int(base.sum())]] += 1
    return [int(x) for x in base]


def assign(n: int, spec: Split, column: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split codes (index into ``spec.fractions``' keys) and folds (-1 outside train) for ``n`` rows.

    Args:
        n: number of rows.
        spec: the split step.
        column: the stratification labels or the time values (required unless ``method == "random"``).
    """
    fractions = list(spec.fractions.values())
    rng = np.random.default_rng(spec.seed)
    codes = np.empty(n, dtype=np.int8)
    if spec.method == "random" or column is None:
        order = rng.permutation(n)
        _fill(codes, order, _counts(n, fractions))
    elif spec.method == "stratified":
        for value in np.unique(column):
            members = np.flatnonzero(column == value)
            _fill(codes, members[rng.permutation(members.size)], _counts(members.size, fractions))
    else:  # time: earliest rows in the first split, then the next, in the order the fractions are given
        _fill(codes, np.argsort(column, kind="stable"), _counts(n, fractions))
    folds = np.full(n, -1, dtype=np.int8)
    if spec.kfold:
        train_code = list(spec.fractions).index("train")
        _assign_folds(folds, codes == train_code, spec, column, rng)
    return codes, folds


def _fill(codes: np.ndarray, order: np.ndarray, counts: list[int]) -> None:
    start = 0
    for code, count in enumerate(counts):
        codes[order[start : start + count]] = code
        start += count


def _assign_folds(
    folds: np.ndarray, train: np.ndarray, spec: Split, column: np.ndarray | None, rng: np.random.Generator
) -> None:
    k = int(spec.kfold or 0)
    idx = np.flatnonzero(train)
    if spec.method == "stratified" and column is not None:
        # Deal each class's rows round-robin into the folds, so every fold keeps the class balance.
        for value in np.unique(column[idx]):
            members = idx[column[idx] == value]
            members = members[rng.permutation(members.size)]
            folds[members] = (np.arange(members.size) + rng.integers(k)) % k
    elif spec.method == "time" and column is not None:
        ordered = idx[np.argsort(column[idx], kind="stable")]
        folds[ordered] = (np.arange(ordered.size) * k // max(1, ordered.size)).astype(np.int8)
    else:
        folds[idx[rng.permutation(idx.size)]] = np.arange(idx.size) % k
