"""Open a dataset version and read it: Arrow, NumPy, its manifest, its quarantine, its fitted transform."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.cache import ShardCache, default_cache
from gpuyard.data.catalog import load_manifest, resolve
from gpuyard.data.columns import TensorSpec, tensor_to_numpy
from gpuyard.data.shards import ShardInfo, read_shard
from gpuyard.errors import ConfigError
from gpuyard.refs import DatasetRef
from gpuyard.settings import load_settings
from gpuyard.store import get_artifacts
from gpuyard.store.artifacts import ArtifactStore

if TYPE_CHECKING:
    from gpuyard.data.fitted import FittedTransform


def shard_location(artifacts: ArtifactStore, shard: ShardInfo, cache: ShardCache | None) -> str:
    """A local path to read ``shard`` from: the artifact file itself when local, else the cache's copy."""
    protocol = artifacts.fs.protocol
    local = "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))
    if local:
        return artifacts._path(shard.key)
    if cache is None:
        cache = default_cache(load_settings().home)
    return str(cache.fetch(artifacts, shard.key, shard.sha256))


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
        """Local paths of every shard (remote stores are read through the local cache)."""
        artifacts = get_artifacts()
        return [shard_location(artifacts, s, cache) for s in self.shards]

    def iter_tables(self, columns: list[str] | None = None, split: str | None = None) -> Iterator[pa.Table]:
        """Each shard as an Arrow table (optionally only some columns, or one split)."""
        self._check_columns(columns)
        wanted = None if columns is None else list(dict.fromkeys([*columns, *(["split"] if split else [])]))
        for shard, path in zip(self.shards, self.shard_paths(), strict=True):
            table = read_shard(path, shard.key, columns=wanted)
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
        return read_shard(artifacts.open(key), key)

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
