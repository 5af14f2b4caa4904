"""Ingest: read a source, clean it, cut it into Parquet shards and record an immutable version."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.catalog import check_new_version_team, record_version
from gpuyard.data.dataset import DatasetVersion, open_dataset
from gpuyard.data.infer import NUMERIC_SHARE, infer_types
from gpuyard.data.manifest import build_manifest, store_quarantine
from gpuyard.data.shards import DEFAULT_SHARD_BYTES, declare_required, split_table, store_shard
from gpuyard.data.sources import Progress, detect_format, read_source
from gpuyard.data.stats import finish, merge, partial_stats
from gpuyard.data.validate import ValidationSpec, check_schema, clean
from gpuyard.errors import ConfigError
from gpuyard.refs import check_dataset_name
from gpuyard.store import get_artifacts


@dataclass(frozen=True)
class IngestOptions:
    """How to ingest a source.

    Attributes:
        format: csv, parquet, jsonl, npy, npz or images; None guesses from the path.
        label_column: the column holding labels (recorded in the manifest; checked against ``labels``).
        labels: the declared label set; rows with other labels are quarantined.
        checks: validation rules (types, nulls, ranges, allowed values, duplicates).
        shard_bytes: target shard size in bytes (in memory, before compression).
        image_size: (height, width) to resize every image of an image folder to.
    """

    format: str | None = None
    label_column: str | None = None
    labels: list[Any] | None = None
    checks: ValidationSpec = field(default_factory=ValidationSpec)
    shard_bytes: int = DEFAULT_SHARD_BYTES
    image_size: tuple[int, int] | None = None


# Repeated header rows named in the manifest (and the summary line); the count is always given.
HEADER_ROWS_LISTED = 20


def header_rows(table: pa.Table) -> np.ndarray:
    """Indices of the rows whose every value is its column's name (a header repeated in the data,
    as when CSV files are concatenated with their headers)."""
    if table.num_rows == 0 or table.num_columns == 0:
        return np.zeros(0, dtype=np.int64)
    same: np.ndarray | None = None
    for name in table.column_names:
        col = table.column(name)
        try:
            text = pc.utf8_trim_whitespace(pc.cast(col, pa.string()))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return np.zeros(0, dtype=np.int64)  # a column that is not text: no row of it is a header
        eq = np.asarray(pc.fill_null(pc.equal(text, name.strip()), False).to_numpy(zero_copy_only=False))
        same = eq if same is None else same & eq
        if not same.any():
            return np.zeros(0, dtype=np.int64)
    assert same is not None
    return np.flatnonzero(same)


def header_warning(quarantine: dict[str, Any]) -> str | None:
    """The one line for repeated header rows of an ingest, or None."""
    count = int((quarantine.get("by_reason") or {}).get("header", 0))
    if not count:
        return None
    listed = quarantine.get("header_rows") or []
    rows = ", ".join(str(r) for r in listed) + (", ..." if count > len(listed) else "")
    return (
        f"{count} row(s) repeat the header (row {rows}, numbered as in `gpuyard data quarantine`): "
        "quarantined as 'header'"
    )


def imputation_lines(manifest: dict[str, Any]) -> list[str]:
    """One line per imputed column: column, how, value and the rows filled."""
    imputed = (manifest.get("recipe") or {}).get("imputed") or {}
    return [
        f"imputed column {name!r}: {d['how']} = {d['value']!r} into {d['rows']} row(s)"
        for name, d in sorted(imputed.items())
    ]


def imputation_leak_warning(manifest: dict[str, Any]) -> str | None:
    """The line for a version whose split's test rows hold values imputed from all rows at ingest.

    Ingest imputes before any split exists, so its statistic saw the rows a later split calls test.
    None when the version has no split or nothing up its lineage was imputed.
    """
    if not manifest.get("splits"):
        return None
    imputed: dict[str, Any] = {}
    parent, seen = manifest.get("parent"), 0
    while parent and seen < 50:
        doc = open_dataset(str(parent)).manifest
        imputed = {**((doc.get("recipe") or {}).get("imputed") or {}), **imputed}
        parent, seen = doc.get("parent"), seen + 1
    if not imputed:
        return None
    cols = ", ".join(f"{c} ({d['how']})" for c, d in sorted(imputed.items()))
    return (
        f"column(s) {cols} were imputed at ingest from all rows, before this split: the test rows "
        "took part in that statistic (impute after splitting, or quarantine the blanks, to avoid it)"
    )


def ingest(
    src: str | Path,
    name: str,
    options: IngestOptions | None = None,
    progress: Progress | None = None,
    team: str | None = None,
) -> DatasetVersion:
    """Ingest ``src`` as a new version of dataset ``name`` and return it (the same version if unchanged).

    Text columns of a CSV source that are numbers but for a few values become numeric, and
    the rows with those values go to the quarantine (the rule: :mod:`gpuyard.data.infer`); what was
    inferred is recorded in the manifest's ``recipe.inference``.

    A new dataset belongs to ``team`` (default: ``default``); a new version keeps its dataset's team.

    Raises:
        ConfigError: bad name, format, or checks naming columns the source lacks; a source with no
            rows, or whose every row was quarantined (no empty versions are recorded); a binary file
            given as CSV or JSONL.
        ConflictError: ``team`` is not the team of the dataset ``name`` already recorded.
        NotFoundError: ``src`` does not exist.
    """
    opts = options or IngestOptions()
    check_dataset_name(name)
    check_new_version_team(name, team)
    if opts.shard_bytes <= 0:
        raise ConfigError(f"shard_bytes must be positive, got {opts.shard_bytes}")
    path = Path(src)
    fmt = opts.format or detect_format(path)
    spec = opts.checks
    label = opts.label_column or spec.label_column
    if label is None and fmt == "images":
        label = "label"
    spec = spec.model_copy(update={"label_column": label, "labels": opts.labels or spec.labels})
    source = read_source(path, fmt, opts.image_size, progress)
    check_schema(source.table.schema, spec)
    if source.table.num_rows == 0:
        what = "only a header" if fmt == "csv" else "no rows"
        raise ConfigError(f"{path} has {what}: an empty dataset is not recorded")
    declared = {n for n, c in spec.columns.items() if c.type is not None}
    headers = header_rows(source.table) if fmt == "csv" else np.zeros(0, dtype=np.int64)
    bad = dict(source.bad)
    for i in headers.tolist():
        bad.setdefault(int(i), "header")
    # Inference looks at the data rows: a repeated header row is one bad row, not a word in every column.
    body = source.table
    if headers.size:
        keep = np.ones(source.table.num_rows, dtype=bool)
        keep[headers] = False
        body = source.table.filter(pa.array(keep))
    guesses = infer_types(body, fmt, declared)
    numeric = {n: g.type for n, g in guesses.items() if g.type is not None}
    cleaned = clean(source.table, spec, bad, numeric)
    if cleaned.kept.num_rows == 0:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(cleaned.by_reason.items(), key=lambda kv: -kv[1]))
        top = max(cleaned.by_reason, key=lambda k: cleaned.by_reason[k])
        hint = "fix the data or the checks"
        if top.startswith("null:"):
            hint += f" (an optional column: 'columns: {{{top[5:]}: {{nullable: true}}}}', or 'nulls: keep')"
        raise ConfigError(
            f"{path}: all {cleaned.rows_in} rows were quarantined ({reasons}); an empty dataset is not "
            f"recorded: {hint}"
        )
    artifacts = get_artifacts()
    shards, parts = [], []
    # Columns without a null are stored as required: cheaper to write and to read (see declare_required).
    kept = declare_required(
        cleaned.kept, [c for c in cleaned.kept.column_names if not cleaned.kept[c].null_count]
    )
    pieces = list(split_table(kept, opts.shard_bytes))
    for i, piece in enumerate(pieces):
        shards.append(store_shard(piece, artifacts))
        parts.append(partial_stats(piece))
        if progress is not None:
            progress("shards", i + 1, len(pieces))
    quarantine = {
        "rows_in": cleaned.rows_in,
        "rows_kept": cleaned.kept.num_rows,
        "rows_quarantined": cleaned.quarantine.num_rows,
        "by_reason": cleaned.by_reason,
        "key": store_quarantine(cleaned.quarantine),
    }
    if headers.size:
        quarantine["header_rows"] = [int(i) for i in headers[:HEADER_ROWS_LISTED]]
    manifest = build_manifest(
        name=name,
        kind="ingest",
        schema=kept.schema,
        shards=shards,
        stats=finish(merge(parts)),
        source={"uri": str(path.resolve()), "format": fmt},
        recipe={
            "checks": spec.model_dump(mode="json"),
            "shard_bytes": opts.shard_bytes,
            "image_size": list(opts.image_size) if opts.image_size else None,
            "imputed": cleaned.imputed,
            "inference": {
                "rule": f"text columns with >= {NUMERIC_SHARE:.0%} numbers are numeric",
                "columns": {n: g.to_json() for n, g in sorted(guesses.items())},
            },
        },
        quarantine=quarantine,
        label_column=label,
    )
    row = record_version(manifest, team)
    return open_dataset(f"{row.dataset}@{row.version}")
