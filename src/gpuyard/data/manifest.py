"""Build a version's manifest: schema, shards, statistics, lineage, recipe, quarantine, fitted statistics."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from gpuyard.data.catalog import version_id
from gpuyard.data.columns import schema_doc
from gpuyard.data.shards import ShardInfo, encode_shard
from gpuyard.store import get_artifacts
from gpuyard.store.base import utcnow

FORMAT = "gpuyard.dataset/1"


def store_quarantine(quarantine: pa.Table) -> str | None:
    """Store the quarantined rows as one Parquet blob; None when there are none."""
    if quarantine.num_rows == 0:
        return None
    return get_artifacts().put_blob(encode_shard(quarantine)).key


def build_manifest(
    *,
    name: str,
    kind: str,
    schema: pa.Schema,
    shards: list[ShardInfo],
    stats: dict[str, Any],
    source: dict[str, Any],
    recipe: dict[str, Any],
    quarantine: dict[str, Any],
    parent: str | None = None,
    label_column: str | None = None,
    fitted: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest document, with its content-addressed ``version`` filled in."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "kind": kind,
        "parent": parent,
        "source": source,
        "recipe": recipe,
        "label_column": label_column,
        "schema": schema_doc(schema),
        "num_rows": sum(s.rows for s in shards),
        "shards": [s.to_json() for s in shards],
        "stats": stats,
        "fitted": fitted or {},
        "quarantine": quarantine,
        **(extra or {}),
    }
    doc["version"] = version_id(doc)
    doc["created_at"] = utcnow().isoformat()
    return doc
