"""Open a dataset version and read it: Arrow, NumPy, its manifest, its quarantine, its fitted transform."""

from __future__ import annotations

import concurrent.futures
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.cache import ShardCache, default_cache, is_verified, mark_verified
from gpuyard.data.catalog import load_manifest, resolve
from gpuyard.data.columns import TensorSpec, tensor_to_numpy
from gpuyard.data.shards import ShardInfo, read_shard
from gpuyard.errors import ConfigError, IntegrityError, NotFoundError
from gpuyard.refs import DatasetRef
from gpuyard.settings import load_settings
from gpuyard.store import get_artifacts
from gpuyard.store.artifacts import CHUNK, ArtifactStore, blob_sha256

if TYPE_CHECKING:
    from gpuyard.data.fitted import FittedTransform


def _mismatch(shard: ShardInfo, actual: str, version: str | None) -> IntegrityError:
    of = f" of {version}" if version else ""
    return IntegrityError(
        f"shard {shard.key}{of} is corrupt: its content hashes to {actual[:12]}..., the catalog "
        f"records {shard.sha256[:12]}... (run `gpuyard data verify` on the version)"
    )


def _read_bytes(path: str, shard: ShardInfo, version: str | None) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError as exc:
        of = f" of {version}" if version else ""
        raise NotFoundError(f"shard {shard.key}{of} is missing from the artifact store ({path})") from exc


# One thread that hashes a shard's bytes while the caller parses them (hashlib and pyarrow both
# release the GIL): on a free core the check then costs little more than the parse.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuyard-shard-hash")


def read_checked(path: str, shard: ShardInfo, version: str | None, columns: list[str] | None) -> pa.Table:
    """Read the local shard file ``path`` once, hash those bytes beside parsing them, and return the
    table only when the hash matches ``shard.sha256``.

    Raises:
        NotFoundError: no such file. IntegrityError: the content does not match (checked before any
            parse error is reported, so a damaged shard is always named as such).
    """
    data = _read_bytes(path, shard, version)
    digest = _HASHER.submit(hashlib.sha256, data)
    name = f"{shard.key} of {version}" if version else shard.key
    try:
        table = read_shard(pa.BufferReader(pa.py_buffer(data)), name, columns=columns)
    except IntegrityError:
        actual = digest.result().hexdigest()
        if actual != shard.sha256:
            raise _mismatch(shard, actual, version) from None
        raise
    actual = digest.result().hexdigest()
    if actual != shard.sha256:
        raise _mismatch(shard, actual, version)
    mark_verified(path, shard.sha256)
    return table


def read_verified(path: str, shard: ShardInfo, version: str | None = None) -> pa.Buffer:
    """The bytes of the local file ``path``, read once and checked against ``shard.sha256``.

    The buffer that was hashed is the one to parse (``pa.BufferReader``): the check costs the hash,
    not a second read.

    Raises:
        NotFoundError: no such file. IntegrityError: the content does not match, naming the shard.
    """
    data = _read_bytes(path, shard, version)
    actual = hashlib.sha256(data).hexdigest()
    if actual != shard.sha256:
        raise _mismatch(shard, actual, version)
    mark_verified(path, shard.sha256)
    return pa.py_buffer(data)


def verify_file(path: str, shard: ShardInfo, version: str | None = None) -> None:
    """Check the local file ``path`` against ``shard.sha256`` unless this process already did.

    Hashed in chunks (no copy of the whole shard in memory); a reader opening the file next finds
    its pages in the OS cache.

    Raises:
        NotFoundError: no such file. IntegrityError: the content does not match, naming the shard.
    """
    if is_verified(path, shard.sha256):
        return
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
    except FileNotFoundError as exc:
        of = f" of {version}" if version else ""
        raise NotFoundError(f"shard {shard.key}{of} is missing from the artifact store ({path})") from exc
    if digest.hexdigest() != shard.sha256:
        raise _mismatch(shard, digest.hexdigest(), version)
    mark_verified(path, shard.sha256)


def _local_path(artifacts: ArtifactStore, shard: ShardInfo, cache: ShardCache | None) -> str:
    protocol = artifacts.fs.protocol
    local = "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))
    if local:
        return artifacts._path(shard.key)
    if cache is None:
        cache = default_cache(load_settings().home)
    return str(cache.fetch(artifacts, shard.key, shard.sha256))


def shard_location(
    artifacts: ArtifactStore, shard: ShardInfo, cache: ShardCache | None, version: str | None = None
) -> str:
    """A local path to read ``shard`` from: the artifact file itself when local, else the cache's copy.

    The file is checked against the catalog's SHA-256 before the path is handed out (once per process
    and file: :func:`verify_file`), for every store: a local one, or a remote one through the cache.

    Raises:
        IntegrityError: the shard's content does not match, in one line naming the shard (and
            ``version`` when given). NotFoundError: the shard is missing.
    """
    path = _local_path(artifacts, shard, cache)
    verify_file(path, shard, version)
    return path


@dataclass
class DatasetVersion:
    """One immutable version of a dataset.

    Attributes:
        name: dataset name.
        version: content address (hex).
        manifest: schema, shards, stats, lineage, recipe, fitted statistics and quarantine counts.
    """

    name: str
    version: str
    manifest: dict[str, Any]

    @property
    def ref(self) -> str:
        """``name@version``."""
        return str(DatasetRef(self.name, self.version))

    @property
    def shards(self) -> list[ShardInfo]:
        """The version's shards, in order."""
        return [ShardInfo.from_json(s) for s in self.manifest["shards"]]

    @property
    def num_rows(self) -> int:
        """Rows in the version (after cleaning)."""
        return int(self.manifest["num_rows"])

    @property
    def columns(self) -> list[str]:
        """Column names."""
        return [c["name"] for c in self.manifest["schema"]]

    @property
    def stats(self) -> dict[str, Any]:
        """Per-column statistics (count, nulls, min, max, mean, std, top values)."""
        return dict(self.manifest["stats"])

    @property
    def fitted(self) -> dict[str, Any]:
        """Statistics fitted by the recipe on the training split (normalisation, categories)."""
        return dict(self.manifest.get("fitted") or {})

    @property
    def label_column(self) -> str | None:
        """The label column, when one was declared."""
        return self.manifest.get("label_column")

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """dtype and shape of each tensor column."""
        return {
            c["name"]: TensorSpec(c["tensor"]["dtype"], tuple(c["tensor"]["shape"]))
            for c in self.manifest["schema"]
            if "tensor" in c
        }

    def shard_paths(self, cache: ShardCache | None = None) -> list[str]:
        """Local paths of every shard (remote stores are read through the local cache), each checked
        against the catalog's SHA-256 (:func:`shard_location`)."""
        artifacts = get_artifacts()
        return [shard_location(artifacts, s, cache, self.ref) for s in self.shards]

    def iter_tables(self, columns: list[str] | None = None, split: str | None = None) -> Iterator[pa.Table]:
        """Each shard as an Arrow table (optionally only some columns, or one split).

        A shard this process has not checked yet is read whole once, and those bytes are hashed (in a
        thread) while they are parsed (:func:`read_checked`); one it has checked (unchanged since) is
        read from its file, only the columns asked.

        Raises:
            IntegrityError: a shard does not match its SHA-256, naming the shard and the version.
        """
        self._check_columns(columns)
        wanted = None if columns is None else list(dict.fromkeys([*columns, *(["split"] if split else [])]))
        artifacts = get_artifacts()
        for shard in self.shards:
            path = _local_path(artifacts, shard, None)
            if is_verified(path, shard.sha256):
                table = read_shard(path, f"{shard.key} of {self.ref}", columns=wanted)
            else:
                table = read_checked(path, shard, self.ref, wanted)
            if split is not None:
                if "split" not in table.column_names:
                    raise ConfigError(f"{self.ref} has no split column; run a recipe with a split step")
                table = table.filter(pc.equal(table.column("split"), split))
                if columns is not None and "split" not in columns:
                    table = table.drop_columns(["split"])
            yield table

    def to_arrow(self, columns: list[str] | None = None, split: str | None = None) -> pa.Table:
        """The whole version (or some columns, or one split) as one Arrow table."""
        tables = list(self.iter_tables(columns, split))
        return pa.concat_tables(tables) if tables else pa.table({})

    def to_numpy(self, columns: list[str] | None = None, split: str | None = None) -> dict[str, np.ndarray]:
        """Columns as NumPy arrays; tensor columns come back as ``(N, *shape)`` arrays."""
        table = self.to_arrow(columns, split)
        specs = self.tensor_specs()
        out: dict[str, np.ndarray] = {}
        for name in table.column_names:
            col = table.column(name)
            if name in specs:
                out[name] = tensor_to_numpy(col, specs[name])
            else:
                out[name] = col.to_numpy()
        return out

    def quarantine(self) -> pa.Table:
        """The quarantined rows: source row index, reason, and the row's values as JSON."""
        from gpuyard.data.validate import QUARANTINE_SCHEMA

        key = self.manifest["quarantine"].get("key")
        if key is None:
            return QUARANTINE_SCHEMA.empty_table()
        artifacts = get_artifacts()
        data = artifacts.get_bytes(key, sha256=blob_sha256(key))  # a blob's key names its SHA-256
        return read_shard(pa.BufferReader(data), f"quarantine {key} of {self.ref}")

    def transform_for_inference(self) -> FittedTransform:
        """The recipe with its fitted statistics, to apply to new rows exactly as training saw them."""
        from gpuyard.data.fitted import FittedTransform

        return FittedTransform.from_manifest(self.manifest)

    def _check_columns(self, columns: list[str] | None) -> None:
        unknown = sorted(set(columns or []) - set(self.columns))
        if unknown:
            raise ConfigError(
                f"{self.ref} has no column(s) {', '.join(unknown)} (has {', '.join(self.columns)})"
            )


def open_dataset(ref: str) -> DatasetVersion:
    """Open ``name`` (latest version), ``name@latest`` or ``name@VERSION`` (a unique hex prefix).

    Raises:
        NotFoundError: no such dataset or version.
    """
    row = resolve(ref)
    return DatasetVersion(name=row.dataset, version=row.version, manifest=load_manifest(row))
