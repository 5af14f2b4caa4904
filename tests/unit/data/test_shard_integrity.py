"""Shards are checked against the catalog's SHA-256 when read; `gpuyard data verify` checks a whole
version; `gpuyard data gc` removes only blobs nothing references, and only when told to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuyard.cli.main import main
from gpuyard.data import DatasetVersion, IngestOptions, ingest
from gpuyard.errors import IntegrityError

pytestmark = pytest.mark.unit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def table(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """A CSV with columns x_00..x_11 and a label, one row quarantined (a quarantine blob too)."""
    rng = np.random.default_rng(0)
    names = [f"x_{i:02d}" for i in range(12)]
    lines = [",".join([*names, "y"])]
    lines += [",".join([*(f"{v:.4f}" for v in rng.normal(size=12)), str(i % 2)]) for i in range(300)]
    lines.append(",".join(["1.0"] * 12 + [""]))  # no label: quarantined
    src = tmp_path / "t.csv"
    src.write_text("\n".join(lines) + "\n")
    return ingest(src, "t", IngestOptions(label_column="y"))


def _shard_file(version: DatasetVersion) -> Path:
    from gpuyard.store import get_artifacts

    return Path(get_artifacts()._path(version.shards[0].key))


def _rename_column_in_footer(path: Path) -> None:
    """x_01 -> x_0! in the Parquet footer (which carries no checksum): the file still parses."""
    data = bytearray(path.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    at = data.find(b"x_01", footer)  # the schema's name comes first in the footer
    assert at > footer
    data[at + 3] = ord("!")
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_a_flipped_footer_byte_fails_the_read_naming_shard_and_version(table: DatasetVersion) -> None:
    import pyarrow.parquet as pq

    from gpuyard.data import open_dataset
    from gpuyard.data.arrays import load_arrays
    from gpuyard.data.cache import _VERIFIED
    from gpuyard.data.dataset import shard_location
    from gpuyard.store import get_artifacts

    path = _shard_file(table)
    _rename_column_in_footer(path)
    assert "x_0!" in pq.ParquetFile(path).schema_arrow.names  # Parquet alone reads it without a word
    _VERIFIED.clear()
    version = open_dataset(table.ref)
    with pytest.raises(IntegrityError) as err:
        version.to_arrow()
    message = str(err.value)
    assert "\n" not in message and table.shards[0].key in message and table.ref in message
    with pytest.raises(IntegrityError, match=table.ref):
        load_arrays(table.ref)
    # The loader's and the transforms' way in (a path per shard) is checked too.
    with pytest.raises(IntegrityError, match=table.shards[0].key):
        shard_location(get_artifacts(), table.shards[0], None)


def test_an_intact_version_reads_and_verifies(
    table: DatasetVersion, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.data import open_dataset

    assert open_dataset(table.ref).to_arrow().num_rows == 300
    assert open_dataset(table.ref).quarantine().num_rows == 1
    code, out, _ = _run(capsys, "data", "verify", table.ref, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["checked"] == 3  # manifest, one shard, quarantine
    _rename_column_in_footer(_shard_file(table))
    code, out, err = _run(capsys, "data", "verify", "t")
    assert code == 1 and table.shards[0].key in err and "catalog records" in err
    assert "1 bad" in out


def test_gc_removes_only_unreferenced_blobs_and_only_when_told(
    table: DatasetVersion, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.data import open_dataset
    from gpuyard.states import RunStatus
    from gpuyard.store import get_artifacts
    from gpuyard.tracking.store import start_run

    artifacts = get_artifacts()
    orphan = artifacts.put_blob(b"written by an ingest that never recorded its version")
    # A blob another component references (a model file, LLM weights): named in a JSON column.
    weights = artifacts.put_blob(b"model weights")
    run = start_run("m", tags={"files": {"w": {"sha256": weights.sha256}}}, system_interval_s=None)
    run.finish(RunStatus.FINISHED)
    # Just written: within the default grace period, so even --yes keeps it.
    code, out, _ = _run(capsys, "data", "gc", "--yes", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["unreferenced"] == [] and doc["kept_too_new"] == 1 and doc["referenced"] == 4
    assert artifacts.exists(orphan.key)
    # Dry run by default.
    code, out, _ = _run(capsys, "data", "gc", "--grace", "0s", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["unreferenced"] == [orphan.key] and not doc["deleted"]
    assert artifacts.exists(orphan.key) and doc["referenced"] == 4
    code, out, _ = _run(capsys, "data", "gc", "--grace", "0s", "--yes")
    assert code == 0 and "deleted 1 blob(s)" in out
    assert not artifacts.exists(orphan.key) and artifacts.exists(weights.key)
    # Everything the version references is still there and intact.
    version = open_dataset(table.ref)
    assert version.to_arrow().num_rows == 300 and version.quarantine().num_rows == 1
    code, _, _ = _run(capsys, "data", "gc", "--grace", "soon")
    assert code == 2


def test_a_rewrite_with_the_old_modification_time_is_not_taken_as_verified(tmp_path: Path) -> None:
    """A file checked once per process is trusted later only while unchanged; an owner who rewrites it
    in place (same inode and size) and sets the modification time back is still caught (change time)."""
    import os

    from gpuyard.data.cache import is_verified, mark_verified

    shard = tmp_path / "shard.parquet"
    shard.write_bytes(b"a" * 64)
    before = os.stat(shard)
    mark_verified(shard, "digest")
    assert is_verified(str(shard), "digest")
    with open(shard, "r+b") as f:  # same inode, same size
        f.write(b"b" * 64)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert not is_verified(str(shard), "digest")
