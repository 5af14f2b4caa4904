"""Run a recipe over a dataset version: fit on the train split, apply shard by shard, record a new version.

Two passes over the shards, both parallel: the first computes partial statistics of the train rows
(sums, min/max, category counts), which are merged into the fitted statistics; the second applies
them and writes the output shards. The fitted statistics are saved in the manifest, and
:class:`~gpuyard.data.fitted.FittedTransform` applies the same transform to new rows at inference time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.catalog import check_new_version_team, record_version
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.features import numeric
from gpuyard.data.fitted import FittedTransform
from gpuyard.data.manifest import build_manifest
from gpuyard.data.parallel import Progress, open_pool, run_tasks
from gpuyard.data.recipe import Recipe
from gpuyard.data.split import assign
from gpuyard.refs import check_dataset_name

# -- tasks run by the pool or by Ray (module-level so they pickle by reference) -----------------------


def _load(task: dict[str, Any]) -> tuple[pa.Table, FittedTransform]:
    from pathlib import Path

    from gpuyard.data.cache import ShardCache
    from gpuyard.data.dataset import shard_location
    from gpuyard.data.shards import ShardInfo, read_shard
    from gpuyard.store.artifacts import ArtifactStore

    artifacts = ArtifactStore(task["root"])
    shard = ShardInfo.from_json(task["shard"])
    cache = ShardCache(Path(task["cache_dir"]), task["cache_bytes"])
    encoded = [e.column for e in Recipe.model_validate(task["recipe"]).encode]
    path = shard_location(artifacts, shard, cache)
    table = read_shard(path, artifacts.url(shard.key), columns=task.get("columns"), dictionary=encoded)
    ft = FittedTransform(Recipe.model_validate(task["recipe"]), task.get("fitted", {}))
    return ft.features(table), ft


def _train_rows(table: pa.Table, task: dict[str, Any]) -> pa.Table:
    if task.get("split") is None:
        return table
    return table.filter(pa.array(task["split"] == task["train_code"]))


def fit_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Partial statistics of one shard's train rows for every normalize and encode step."""
    table, ft = _load(task)
    train = _train_rows(table, task)
    out: dict[str, Any] = {"normalize": {}, "encode": {}}
    for step in ft.recipe.normalize:
        for col in step.columns:
            v = numeric(train.column(col))
            v = v[np.isfinite(v)]
            out["normalize"][col] = {
                "n": int(v.size),
                "sum": float(v.sum()),
                "sumsq": float(np.square(v).sum()),
                "min": float(v.min()) if v.size else None,
                "max": float(v.max()) if v.size else None,
            }
    for e in ft.recipe.encode:
        counts = pc.value_counts(pc.drop_null(train.column(e.column)).combine_chunks())
        out["encode"][e.column] = {c["values"].as_py(): int(c["counts"].as_py()) for c in counts}
    return out


def apply_shard(task: dict[str, Any]) -> dict[str, Any]:
    """Transform one shard, store it, and return its shard info and partial statistics."""
    from gpuyard.data.shards import store_shard
    from gpuyard.data.stats import partial_stats
    from gpuyard.store.artifacts import ArtifactStore

    table, ft = _load(task)
    if task.get("split") is not None:
        names = np.array(task["split_names"], dtype=object)
        table = table.append_column("split", pa.array(names[task["split"]], pa.string()))
        if task.get("fold") is not None:
            table = table.append_column("fold", pa.array(task["fold"].astype(np.int8)))
    table = ft.finish(table)
    info = store_shard(table, ArtifactStore(task["root"]))
    return {"shard": info.to_json(), "stats": partial_stats(table), "schema": table.schema}


def fit_from_stats(recipe: Recipe, ds: DatasetVersion) -> dict[str, Any] | None:
    """Fitted statistics read from the version's own column statistics, when they are exactly those.

    Without a split the train rows are all rows, and the manifest already holds each input column's
    count, sum-based mean and std, min, max and (for text with at most 20 values) every category:
    the fit pass would compute the same figures again. None when a step needs a real fit pass.
    """
    if recipe.split is not None or recipe.derive or recipe.image or recipe.text_hash:
        return None
    stats = ds.stats
    fitted: dict[str, Any] = {"normalize": {}, "encode": {}}
    for step in recipe.normalize:
        for col in step.columns:
            st = stats.get(col, {})
            if st.get("kind") not in ("int", "float") or st.get("mean") is None:
                return None
            n = int(st["count"]) - int(st["nulls"])
            if step.method == "zscore":
                fitted["normalize"][col] = {"method": "zscore", "mean": st["mean"], "std": st["std"], "n": n}
            else:
                fitted["normalize"][col] = {"method": "minmax", "min": st["min"], "max": st["max"], "n": n}
    for e in recipe.encode:
        st = stats.get(e.column, {})
        top = st.get("top")
        if st.get("kind") != "string" or top is None or st.get("distinct") != len(top):
            return None
        fitted["encode"][e.column] = {"method": e.method, "categories": sorted(top), "counts": dict(top)}
    return fitted


def merge_fit(recipe: Recipe, partials: list[dict[str, Any]]) -> dict[str, Any]:
    """Fitted statistics from the shards' partials (z-score: mean/std; min-max: min/max; categories)."""
    fitted: dict[str, Any] = {"normalize": {}, "encode": {}}
    for step in recipe.normalize:
        for col in step.columns:
            parts = [p["normalize"][col] for p in partials]
            n = sum(p["n"] for p in parts)
            mins = [p["min"] for p in parts if p["min"] is not None]
            maxs = [p["max"] for p in parts if p["max"] is not None]
            mean = sum(p["sum"] for p in parts) / n if n else 0.0
            var = max(0.0, sum(p["sumsq"] for p in parts) / n - mean * mean) if n else 0.0
            if step.method == "zscore":
                fitted["normalize"][col] = {
                    "method": "zscore",
                    "mean": mean,
                    "std": float(np.sqrt(var)),
                    "n": n,
                }
            else:
                lo, hi = (min(mins), max(maxs)) if mins else (0.0, 0.0)
                fitted["normalize"][col] = {"method": "minmax", "min": lo, "max": hi, "n": n}
    for e in recipe.encode:
        counts: Counter[Any] = Counter()
        for p in partials:
            counts.update(p["encode"][e.column])
        fitted["encode"][e.column] = {
            "method": e.method,
            "categories": sorted(counts),
            "counts": dict(counts),
        }
    return fitted


def _split_tasks(ds: DatasetVersion, recipe: Recipe) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per-shard task arguments with their slices of the split and fold assignments."""
    from gpuyard.data.cache import default_cache
    from gpuyard.settings import load_settings
    from gpuyard.store import get_artifacts

    cache = default_cache(load_settings().home)
    base = {
        "root": get_artifacts().root_url,
        "recipe": recipe.to_json(),
        "cache_dir": str(cache.root),
        "cache_bytes": cache.max_bytes,
    }
    tasks = [{**base, "shard": s.to_json()} for s in ds.shards]
    counts: dict[str, int] = {}
    if recipe.split is None:
        return tasks, counts
    spec = recipe.split
    column = ds.to_numpy([spec.column])[spec.column] if spec.column else None
    codes, folds = assign(ds.num_rows, spec, column)
    names = list(spec.fractions)
    start = 0
    for task, shard in zip(tasks, ds.shards, strict=True):
        task.update(
            split=codes[start : start + shard.rows],
            fold=folds[start : start + shard.rows] if spec.kfold else None,
            split_names=names,
            train_code=names.index("train"),
        )
        start += shard.rows
    found = np.bincount(codes, minlength=len(names))
    counts = {name: int(found[i]) for i, name in enumerate(names)}
    return tasks, counts


def transform(
    ref: str,
    recipe: Recipe,
    *,
    output: str | None = None,
    engine: str = "pool",
    workers: int | None = None,
    ray_address: str | None = None,
    progress: Progress | None = None,
    team: str | None = None,
) -> DatasetVersion:
    """Apply ``recipe`` to the version ``ref`` and record the result as a new version.

    Args:
        ref: ``name`` or ``name@version`` of the input.
        recipe: the recipe; every column it names is checked before any work starts.
        output: dataset name of the result (default: a new version of the input's dataset).
        engine: ``pool``, ``ray`` or ``serial`` (see :func:`gpuyard.data.parallel.run_tasks`).
        workers: process-pool size.
        ray_address: Ray cluster address for ``engine="ray"``.
        progress: called with (stage, done, total).
        team: the team of a new ``output`` dataset (default: ``default``); a new version of an
            existing dataset keeps its dataset's team.

    Raises:
        ConfigError: the recipe names an unknown column or one of the wrong kind.
        ConflictError: ``team`` is not the team of the output dataset already recorded.
    """
    from gpuyard.data.stats import finish, merge

    ds = open_dataset(ref)
    name = check_dataset_name(output or ds.name)
    check_new_version_team(name, team)
    recipe.check({c["name"]: c["kind"] for c in ds.manifest["schema"]})
    tasks, split_counts = _split_tasks(ds, recipe)
    fitted: dict[str, Any] = {}
    with open_pool(engine, workers, len(tasks)) as pool:
        run: dict[str, Any] = {
            "engine": engine,
            "workers": workers,
            "ray_address": ray_address,
            "progress": progress,
            "executor": pool,
        }
        if recipe.needs_fit:
            fitted = fit_from_stats(recipe, ds) or {}
        if recipe.needs_fit and not fitted:
            # The fit pass reads only the columns the steps use (and the split comes with the task).
            needed = [c for c in recipe.input_columns() if c in ds.columns]
            fit_tasks = [{**t, "columns": needed} for t in tasks]
            fitted = merge_fit(recipe, run_tasks(fit_shard, fit_tasks, stage="fit", **run))
        results = run_tasks(apply_shard, [{**t, "fitted": fitted} for t in tasks], stage="apply", **run)
    from gpuyard.data.shards import ShardInfo

    shards = [ShardInfo.from_json(r["shard"]) for r in results]
    label = ds.label_column if ds.label_column in results[0]["schema"].names else None
    manifest = build_manifest(
        name=name,
        kind="transform",
        schema=results[0]["schema"],
        shards=shards,
        stats=finish(merge([r["stats"] for r in results])),
        source={"uri": ds.ref, "format": "dataset"},
        recipe=recipe.to_json(),
        quarantine={"rows_in": ds.num_rows, "rows_kept": ds.num_rows, "rows_quarantined": 0, "by_reason": {}},
        parent=ds.ref,
        label_column=label,
        fitted=fitted,
        extra={"splits": split_counts, "kfold": recipe.split.kfold if recipe.split else None},
    )
    row = record_version(manifest, team)
    return open_dataset(f"{row.dataset}@{row.version}")
