"""`gpuyard data ...`: JSON documents on stdout, one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main

pytestmark = pytest.mark.unit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_ingest_transform_show_ls_quarantine(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "people.csv"
    src.write_text(
        "age,height,color,label\n34,1.8,red,y\n,1.7,blue,n\n29,1.6,red,y\n200,1.6,green,n\n41,1.7,blue,q\n"
    )
    checks = tmp_path / "checks.yaml"
    checks.write_text("columns:\n  age: {type: float, min: 0, max: 130}\n")
    code, out, _ = _run(
        capsys, "data", "ingest", str(src), "--name", "people", "--label-column", "label",
        "--labels", "y,n", "--checks", str(checks), "--json",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert doc["rows_in"] == 5 and doc["rows"] == 2 and doc["rows_quarantined"] == 3
    assert doc["quarantine"] == {"null:age": 1, "range:age": 1, "label": 1}
    code, out, _ = _run(capsys, "data", "quarantine", doc["ref"], "--json")
    q = json.loads(out)
    assert code == 0 and {r["reason"] for r in q["rows"]} == {"null:age", "range:age", "label"}
    assert q["rows_kept"] + q["rows_quarantined"] == q["rows_in"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("normalize: [{columns: [age], method: minmax}]\nencode: [{column: color}]\n")
    code, out, _ = _run(
        capsys, "data", "transform", "people", "--recipe", str(recipe), "--engine", "serial", "--json"
    )
    t = json.loads(out)
    assert code == 0 and t["parent"] == doc["ref"] and t["fitted"]["normalize"]["age"]["max"] == 34.0
    code, out, _ = _run(capsys, "data", "show", "people", "--json")
    manifest = json.loads(out)
    assert manifest["version"] == t["version"]
    assert {c["name"]: c["kind"] for c in manifest["schema"]}["color"] == "tensor"
    code, out, _ = _run(capsys, "data", "ls", "--json")
    assert [d["dataset"] for d in json.loads(out)] == ["people"] and json.loads(out)[0]["versions"] == 2
    code, out, _ = _run(capsys, "data", "show", "people")
    assert code == 0 and "lineage" in out and "age" in out


def test_errors_are_one_line_with_exit_2(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.csv"
    src.write_text("x\n1\n2\n")
    assert _run(capsys, "data", "ingest", str(src), "--name", "a", "--json")[0] == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("normalize: [{columns: [nope]}]\n")
    code, out, err = _run(capsys, "data", "transform", "a", "--recipe", str(bad))
    assert code == 2 and "nope" in err and len(err.strip().splitlines()) == 1 and out == ""
    code, _, err = _run(capsys, "data", "show", "missing")
    assert code == 2 and "missing" in err
    code, _, err = _run(capsys, "data", "ingest", str(src), "--name", "a", "--shard-size", "lots")
    assert code == 2 and "--shard-size" in err
