"""Ingest: read a source, clean it, cut it into Parquet shards and record an immutable version."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    guesses = infer_types(source.table, fmt, declared)
    numeric = {n: g.type for n, g in guesses.items() if g.type is not None}
    cleaned = clean(source.table, spec, source.bad, numeric)
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
