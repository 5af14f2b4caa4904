"""The dataset catalog on a real PostgreSQL server: record, resolve, list, idempotent re-ingest."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.data import ingest, list_datasets, list_versions, load_recipe, open_dataset, transform
from gpuyard.errors import NotFoundError

pytestmark = pytest.mark.integration


def test_catalog_on_postgresql(
    gpuyard_home: Path, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUYARD_DATABASE_URL", pg_url)
    src = tmp_path / "t.csv"
    src.write_text("x,y\n1,a\n2,b\n3,a\n3,a\n")
    v1 = ingest(src, "pg-data")
    assert v1.manifest["quarantine"]["by_reason"] == {"duplicate": 1}
    assert ingest(src, "pg-data").version == v1.version
    v2 = transform("pg-data", load_recipe("encode: [{column: y, method: ordinal}]"), engine="serial")
    assert [v["version"] for v in list_versions("pg-data")] == [v2.version, v1.version]
    assert open_dataset(f"pg-data@{v1.version}").to_arrow().column("x").to_pylist() == [1, 2, 3]
    assert open_dataset("pg-data").to_arrow().column("y").to_pylist() == [0, 1, 0]
    assert list_datasets()[0]["rows_quarantined"] == 0  # latest version: the transform
    with pytest.raises(NotFoundError):
        open_dataset("pg-data@ffffff")
