"""Ingest every source format into content-addressed, sharded versions recorded in the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpuyard.data import IngestOptions, ValidationSpec, ingest, list_datasets, list_versions, open_dataset
from gpuyard.errors import ConfigError, IntegrityError, NotFoundError
from gpuyard.store import get_artifacts

pytestmark = pytest.mark.unit


def test_npz_ingest_shards_stats_and_reads_back(gpuyard_home: Path, digits_npz: Path, digits: tuple) -> None:
    images, labels = digits
    v = ingest(
        digits_npz, "digits", IngestOptions(label_column="label", labels=list(range(10)), shard_bytes=200_000)
    )
    assert v.num_rows == 1797 and len(v.shards) > 2
    assert sum(s.rows for s in v.shards) == 1797
    assert v.tensor_specs()["image"].shape == (8, 8)
    assert v.columns[:2] == ["pixels_00", "pixels_01"] and "label" in v.columns
    arrays = v.to_numpy(["image", "label"])
    np.testing.assert_array_equal(arrays["image"], images)
    np.testing.assert_array_equal(arrays["label"], labels)
    assert v.stats["label"]["distinct"] == 10
    assert v.stats["pixels_05"]["mean"] == pytest.approx(images.reshape(-1, 64)[:, 5].mean())
    assert v.manifest["quarantine"]["rows_in"] == 1797 and v.manifest["label_column"] == "label"
    # Shards are content-addressed blobs in the artifact store.
    for shard in v.shards:
        assert get_artifacts().sha256(shard.key) == shard.sha256 and shard.sha256 in shard.key


def test_versions_are_content_addressed(gpuyard_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "a.csv"
    src.write_text("x,y\n1,a\n2,b\n")
    v1 = ingest(src, "t")
    assert ingest(src, "t").version == v1.version  # same content: the same version, recorded once
    src.write_text("x,y\n1,a\n2,c\n")
    v2 = ingest(src, "t")
    assert v2.version != v1.version
    assert [v["version"] for v in list_versions("t")] == [v2.version, v1.version]
    assert open_dataset("t").version == v2.version
    assert open_dataset(f"t@{v1.version[:6]}").version == v1.version
    assert list_datasets()[0]["versions"] == 2
    with pytest.raises(NotFoundError, match="nope"):
        open_dataset("nope")
    with pytest.raises(NotFoundError, match="abcdef"):
        open_dataset("t@abcdef")
    with pytest.raises(ConfigError):
        open_dataset("bad/name")


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl", "npy"])
def test_other_formats(gpuyard_home: Path, tmp_path: Path, fmt: str) -> None:
    rows = [{"a": i, "b": float(i) / 2, "c": f"s{i % 3}"} for i in range(50)]
    path = tmp_path / f"src.{fmt}"
    if fmt == "csv":
        path.write_text("a,b,c\n" + "".join(f"{r['a']},{r['b']},{r['c']}\n" for r in rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        np.save(path, np.arange(150, dtype=np.float32).reshape(50, 3))
    v = ingest(path, f"src-{fmt}")
    assert v.num_rows == 50 and v.manifest["source"]["format"] == fmt
    if fmt == "npy":
        assert v.columns == ["src_0", "src_1", "src_2"]
    else:
        assert v.to_arrow().column("a").to_pylist() == list(range(50))


def test_image_folder_quarantines_the_corrupt_image(gpuyard_home: Path, image_folder: Path) -> None:
    v = ingest(image_folder, "imgs")
    q = v.manifest["quarantine"]
    assert q["rows_in"] == 61 and q["rows_kept"] == 60 and q["by_reason"] == {"image:corrupt": 1}
    bad = v.quarantine().to_pylist()
    assert json.loads(bad[0]["values"])["path"] == "1/broken.png"
    arrays = v.to_numpy(["image", "label"])
    assert arrays["image"].shape == (60, 8, 8) and set(arrays["label"]) == {"0", "1", "2"}
    assert v.label_column == "label"
    resized = ingest(image_folder, "imgs16", IngestOptions(image_size=(16, 12)))
    assert resized.tensor_specs()["image"].shape == (16, 12)


def test_bad_inputs_are_refused(gpuyard_home: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        ingest(tmp_path / "missing.csv", "x")
    (tmp_path / "f.txt").write_text("hello")
    with pytest.raises(ConfigError, match="--format"):
        ingest(tmp_path / "f.txt", "x")
    (tmp_path / "ok.csv").write_text("a\n1\n")
    with pytest.raises(ConfigError, match="agee"):
        ingest(tmp_path / "ok.csv", "x", IngestOptions(checks=ValidationSpec(required=["agee"])))
    np.savez(tmp_path / "ragged.npz", a=np.ones(3), b=np.ones(4))
    with pytest.raises(ConfigError, match="first dimension"):
        ingest(tmp_path / "ragged.npz", "x")


def test_corrupt_stored_shard_names_the_file(gpuyard_home: Path, digits_npz: Path) -> None:
    v = ingest(digits_npz, "digits")
    path = Path(v.shard_paths()[0])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(IntegrityError, match=path.name):
        v.to_arrow()
