"""Parquet shards: cut a table into shards of a target size, store them content-addressed, read them back.

Shards are written with page checksums and read with checksum verification, so a flipped byte is
reported as an error naming the shard instead of silently feeding wrong samples to training.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
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


# Compression is skipped for a float or tensor column whose sample snappy shrinks by less than this:
# snappy is slow on data it can barely shrink (a float32 column of 1,000 distinct values: 7-10 ms of
# write per 1.4M rows to save 24%), while integer-valued floats and images shrink by half or more.
MIN_SAVING = 1 / 3
# Bytes of each float or tensor column's first rows that decide (a few dozen microseconds of snappy).
SAMPLE_BYTES = 64 << 10


def _delta_columns(schema: pa.Schema, dictionary: list[str]) -> list[str]:
    # Integers are delta-encoded (DELTA_BINARY_PACKED, a standard Parquet encoding): ids and
    # counters shrink to a few bits per value and small codes to their bit width, and both write
    # and read several times faster than plain values through snappy (per 1.4M int64: write 12 ->
    # 5 ms, read 15 -> 1.4 ms for an id; random values in [0, 1e6): 7.0 -> 3.8 MB).
    return [f.name for f in schema if pa.types.is_integer(f.type) and f.name not in dictionary]


def _incompressible(sample: pa.Table | None, skip: list[str]) -> list[str]:
    """Fixed-width columns (floats, tensors) of ``sample`` that snappy would not shrink by MIN_SAVING.

    Measured on the first SAMPLE_BYTES of each: random floats (features, normalised values) do not
    compress, and snappy still costs their write and their every read (per 1.4M rows of 4 float64
    columns: read 14 -> 9 ms); integer-valued floats or images do, and keep it.
    """
    if sample is None or sample.num_rows == 0:
        return []
    out = []
    for f in sample.schema:
        if f.name in skip or not (pa.types.is_floating(f.type) or pa.types.is_fixed_size_binary(f.type)):
            continue
        width = f.type.byte_width if pa.types.is_fixed_size_binary(f.type) else f.type.bit_width // 8
        if width == 0:
            continue
        col = sample.column(f.name).slice(0, max(1, SAMPLE_BYTES // width)).combine_chunks()
        if col.null_count:  # nulls leave holes that Parquet does not store: keep the default
            continue
        data = col.buffers()[1]
        assert data is not None
        data = data.slice(col.offset * width, len(col) * width)
        if len(pa.compress(data, "snappy", asbytes=True)) > (1 - MIN_SAVING) * data.size:
            out.append(f.name)
    return out


def _write_options(schema: pa.Schema, sample: pa.Table | None = None) -> dict[str, Any]:
    """Writer settings for a shard of ``schema``; ``sample``: its first rows, which choose compression.

    The same first rows give the same settings: a shard written whole (:func:`encode_shard`) or
    piece by piece (:class:`ShardWriter`, which decides at its first row group) is encoded alike.
    """
    dictionary = _dictionary_columns(schema)
    delta = _delta_columns(schema, dictionary)
    plain = _incompressible(sample, dictionary)
    opts: dict[str, Any] = {
        "compression": {f.name: "none" if f.name in plain else COMPRESSION for f in schema} or COMPRESSION,
        "use_dictionary": dictionary,
        "write_page_checksum": True,
        "write_statistics": False,
    }
    if delta:
        opts["column_encoding"] = dict.fromkeys(delta, "DELTA_BINARY_PACKED")
    return opts


def declare_required(table: pa.Table, columns: Iterable[str]) -> pa.Table:
    """``table`` with ``columns`` declared non-nullable (Parquet: required), as they hold no nulls.

    A required column is stored without definition levels, which Arrow encodes and decodes value by
    value even when every value is present: per 1.4M rows, six columns (an id, four float64, a text)
    read in 20.5 ms instead of 26.5 ms, and four float32 ones write in 9 ms instead of 14 ms.
    Whoever declares a column must know it holds no nulls in any shard of the version (a version's
    shards share one schema); a null in one is an error, never written.

    Raises:
        IntegrityError: a named column holds a null.
    """
    names = set(columns) & set(table.column_names)
    if not names or all(not table.schema.field(n).nullable for n in names):
        return table
    fields = []
    for f in table.schema:
        if f.name in names and f.nullable:
            if table.column(f.name).null_count:
                raise IntegrityError(f"column {f.name!r} was declared without nulls but holds some")
            f = f.with_nullable(False)
        fields.append(f)
    return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def encode_shard(table: pa.Table) -> bytes:
    """The Parquet bytes of ``table`` (:func:`_write_options`, row groups of about 8 MiB)."""
    sink = io.BytesIO()
    group_rows = rows_per_shard(table, ROW_GROUP_BYTES)
    options = _write_options(table.schema, table.slice(0, group_rows))
    pq.write_table(table, sink, row_group_size=group_rows, **options)
    return sink.getvalue()


class ShardWriter:
    """Encode a shard piece by piece, as :func:`encode_shard` encodes a whole table.

    Pieces are written as they come (a transform never holds a whole shard decoded), gathered into
    row groups of ``group_rows`` rows (the last one shorter): the same settings, the same layout.
    The Parquet writer opens with the first row group, whose rows choose the settings as
    :func:`encode_shard`'s first row group does.
    """

    def __init__(self, schema: pa.Schema, group_rows: int) -> None:
        self.sink = pa.BufferOutputStream()
        self.schema = schema
        self.group_rows = max(1, group_rows)
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def _write(self, rows: pa.Table) -> None:
        if self._writer is None:
            options = _write_options(self.schema, rows.slice(0, self.group_rows))
            self._writer = pq.ParquetWriter(self.sink, self.schema, **options)
        self._writer.write_table(rows, row_group_size=self.group_rows)
        self.rows += rows.num_rows

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
            self._write(rows.slice(0, full))
            rest = rows.slice(full)
            self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def finish(self) -> pa.Buffer:
        """Write what is left and close: the Parquet bytes."""
        if self._pending_rows or self.rows == 0:
            self._write(pa.concat_tables(self._pending) if self._pending else self.schema.empty_table())
        assert self._writer is not None
        self._writer.close()
        return self.sink.getvalue()


def store_shard(table: pa.Table, artifacts: ArtifactStore) -> ShardInfo:
    """Encode ``table`` and store it content-addressed; identical shards are stored once."""
    data = encode_shard(table)
    info = artifacts.put_blob(data)
    return ShardInfo(key=info.key, sha256=info.sha256, rows=table.num_rows, bytes=info.size)


def store_encoded(data: pa.Buffer, rows: int, artifacts: ArtifactStore) -> ShardInfo:
    """Store Parquet bytes of ``rows`` rows (from :class:`ShardWriter`) content-addressed."""
    info = artifacts.put_blob(memoryview(data))  # hashed and written in place: no copy
    return ShardInfo(key=info.key, sha256=info.sha256, rows=rows, bytes=info.size)


def split_table(table: pa.Table, target_bytes: int) -> Iterator[pa.Table]:
    """Slices of ``table`` of about ``target_bytes`` each (at least one, even when empty)."""
    step = rows_per_shard(table, target_bytes)
    if table.num_rows == 0:
        yield table
        return
    for start in range(0, table.num_rows, step):
        yield table.slice(start, step)


def open_parquet(
    source: Any, name: str, dictionary: list[str] | None = None, metadata: pq.FileMetaData | None = None
) -> pq.ParquetFile:
    """Open a Parquet shard (a path or a file object), naming ``name`` in every error.

    ``dictionary`` names text columns to read dictionary-encoded (as stored: no hashing);
    ``metadata``: the footer of the same file, already read by an earlier open (not read again).
    """
    try:
        return pq.ParquetFile(
            source, page_checksum_verification=True, read_dictionary=dictionary, metadata=metadata
        )
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
