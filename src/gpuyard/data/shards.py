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


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    # Dictionary encoding pays off for text and for columns known to hold few distinct values (one-hot
    # vectors: k + 1 values, so pages of small indices instead of k bytes per row to compress);
    # on numbers and other tensors it mostly costs write time.
    return [
        f.name
        for f in schema
        if pa.types.is_string(f.type)
        or pa.types.is_large_string(f.type)
        or (f.metadata or {}).get(FEW_VALUES_KEY) is not None
    ]


def _write_options(schema: pa.Schema) -> dict[str, Any]:
    return {
        "compression": COMPRESSION,
        "use_dictionary": _dictionary_columns(schema),
        "write_page_checksum": True,
        "write_statistics": False,
    }


def encode_shard(table: pa.Table) -> bytes:
    """The Parquet bytes of ``table`` (snappy, page checksums, row groups of about 8 MiB)."""
    sink = io.BytesIO()
    group_rows = rows_per_shard(table, ROW_GROUP_BYTES)
    pq.write_table(table, sink, row_group_size=group_rows, **_write_options(table.schema))
    return sink.getvalue()


class ShardWriter:
    """Encode a shard piece by piece, as :func:`encode_shard` encodes a whole table.

    Pieces are written as they come (a transform never holds a whole shard decoded), gathered into
    row groups of ``group_rows`` rows (the last one shorter): the same settings, the same layout.
    """

    def __init__(self, schema: pa.Schema, group_rows: int) -> None:
        self.sink = pa.BufferOutputStream()
        self.schema = schema
        self.group_rows = max(1, group_rows)
        self.rows = 0
        self._writer = pq.ParquetWriter(self.sink, schema, **_write_options(schema))
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    @classmethod
    def like(cls, first: pa.Table) -> ShardWriter:
        """A writer whose row groups hold about ROW_GROUP_BYTES of rows like ``first``'s."""
        return cls(first.schema, rows_per_shard(first, ROW_GROUP_BYTES))

    def write(self, table: pa.Table) -> None:
        """Add rows (their schema must be the writer's)."""
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self.group_rows:
            rows = pa.concat_tables(self._pending)
            full = rows.num_rows - rows.num_rows % self.group_rows
            self._writer.write_table(rows.slice(0, full), row_group_size=self.group_rows)
            self.rows += full
            rest = rows.slice(full)
            self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def finish(self) -> pa.Buffer:
        """Write what is left and close: the Parquet bytes."""
        if self._pending_rows or self.rows == 0:
            rows = pa.concat_tables(self._pending) if self._pending else self.schema.empty_table()
            self._writer.write_table(rows, row_group_size=self.group_rows)
            self.rows += rows.num_rows
        self._writer.close()
        return self.sink.getvalue()


def store_shard(table: pa.Table, artifacts: ArtifactStore) -> ShardInfo:
    """Encode ``table`` and store it content-addressed; identical shards are stored once."""
    data = encode_shard(table)
    info = artifacts.put_blob(data)
    return ShardInfo(key=info.key, sha256=info.sha256, rows=table.num_rows, bytes=info.size)


def store_encoded(data: pa.Buffer, rows: int, artifacts: ArtifactStore) -> ShardInfo:
    """Store Parquet bytes of ``rows`` rows (from :class:`ShardWriter`) content-addressed."""
    info = artifacts.put_blob(pa.BufferReader(data))
    return ShardInfo(key=info.key, sha256=info.sha256, rows=rows, bytes=info.size)


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


def read_groups(
    pf: pq.ParquetFile, name: str, row_groups: list[int], columns: list[str] | None = None
) -> pa.Table:
    """Some row groups of an open shard (page checksums verified as it was opened)."""
    try:
        if not row_groups:
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
