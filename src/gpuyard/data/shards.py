"""Parquet shards: cut a table into shards of a target size, store them content-addressed, read them back.

Shards are written with page checksums and read with checksum verification, so a flipped byte is
reported as an error naming the shard instead of silently feeding wrong samples to training.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gpuyard.errors import IntegrityError, NotFoundError
from gpuyard.store.artifacts import ArtifactStore

DEFAULT_SHARD_BYTES = 128 << 20
# Row groups are the unit a loader can read alone; ~8 MiB keeps partial reads cheap and decoding fast.
ROW_GROUP_BYTES = 8 << 20
COMPRESSION = "snappy"
# Field metadata marking a column with few distinct values (written dictionary-encoded).
FEW_VALUES_KEY = b"gpuyard.few_values"


@dataclass(frozen=True)
class ShardInfo:
    """One stored shard: artifact key, SHA-256, row count and size in bytes."""

    key: str
    sha256: str
    rows: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        """The form stored in manifests."""
        return {"key": self.key, "sha256": self.sha256, "rows": self.rows, "bytes": self.bytes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ShardInfo:
        """Inverse of :meth:`to_json`."""
        return cls(key=doc["key"], sha256=doc["sha256"], rows=int(doc["rows"]), bytes=int(doc["bytes"]))


def rows_per_shard(table: pa.Table, target_bytes: int) -> int:
    """How many rows of ``table`` make about ``target_bytes`` (measured in memory, before compression)."""
    if table.num_rows == 0:
        return 1
    per_row = max(1.0, table.nbytes / table.num_rows)
    return max(1, int(target_bytes // per_row))


def encode_shard(table: pa.Table) -> bytes:
    """The Parquet bytes of ``table`` (snappy, page checksums, row groups of about 8 MiB)."""
    sink = io.BytesIO()
    group_rows = rows_per_shard(table, ROW_GROUP_BYTES)
    # Dictionary encoding pays off for text and for columns known to hold few distinct values (one-hot
    # vectors: k + 1 values, so pages of small indices instead of k bytes per row to compress);
    # on numbers and other tensors it mostly costs write time.
    few = [
        f.name
        for f in table.schema
        if pa.types.is_string(f.type)
        or pa.types.is_large_string(f.type)
        or (f.metadata or {}).get(FEW_VALUES_KEY) is not None
    ]
    pq.write_table(
        table,
        sink,
        compression=COMPRESSION,
        row_group_size=group_rows,
        use_dictionary=few,
        write_page_checksum=True,
        write_statistics=False,
    )
    return sink.getvalue()


def store_shard(table: pa.Table, artifacts: ArtifactStore) -> ShardInfo:
    """Encode ``table`` and store it content-addressed; identical shards are stored once."""
    data = encode_shard(table)
    info = artifacts.put_blob(data)
    return ShardInfo(key=info.key, sha256=info.sha256, rows=table.num_rows, bytes=info.size)


def split_table(table: pa.Table, target_bytes: int) -> Iterator[pa.Table]:
    """Slices of ``table`` of about ``target_bytes`` each (at least one, even when empty)."""
    step = rows_per_shard(table, target_bytes)
    if table.num_rows == 0:
        yield table
        return
    for start in range(0, table.num_rows, step):
        yield table.slice(start, step)


def open_parquet(source: Any, name: str, dictionary: list[str] | None = None) -> pq.ParquetFile:
    """Open a Parquet shard (a path or a file object), naming ``name`` in every error.

    ``dictionary`` names text columns to read dictionary-encoded (as stored: no hashing).
    """
    try:
        return pq.ParquetFile(source, page_checksum_verification=True, read_dictionary=dictionary)
    except FileNotFoundError as exc:
        raise NotFoundError(f"shard {name} does not exist") from exc
    except (pa.ArrowException, OSError) as exc:
        raise IntegrityError(f"shard {name} is truncated or corrupt: {exc}") from exc


def read_shard(
    source: Any,
    name: str,
    columns: list[str] | None = None,
    row_groups: list[int] | None = None,
    dictionary: list[str] | None = None,
) -> pa.Table:
    """Read a whole shard, or some of its row groups, verifying page checksums.

    Raises:
        IntegrityError: the file is truncated, not Parquet, or a page fails its checksum.
    """
    pf = open_parquet(source, name, dictionary)
    try:
        if row_groups is None:
            return pf.read(columns=columns, use_threads=False)
        return pf.read_row_groups(row_groups, columns=columns, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise IntegrityError(f"shard {name} is truncated or corrupt: {exc}") from exc


def row_group_bounds(pf: pq.ParquetFile) -> list[tuple[int, int]]:
    """(first row, row count) of every row group of an open shard."""
    out, start = [], 0
    for i in range(pf.num_row_groups):
        n = pf.metadata.row_group(i).num_rows
        out.append((start, n))
        start += n
    return out
