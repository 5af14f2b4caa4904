"""Imputation uses exact statistics of the rows that are kept, ingest names each imputation, and a
repeated header row is one quarantined row with one line, not a warning per column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuyard.cli.main import main
from gpuyard.data import IngestOptions, ValidationSpec, ingest

pytestmark = pytest.mark.unit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    text = [",".join(header)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
    path.write_text("\n".join(text) + "\n")
    return path


def test_median_is_exact_and_ignores_quarantined_rows(gpuyard_home: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = np.round(rng.normal(14, 3.5, 569), 2)  # approximate_median says 13.8994, the median is 13.92
    rows: list[list[object]] = [[i, float(v), 1.0, i % 2] for i, v in enumerate(a)]
    rows += [[-1, None, 1.0, 0], [-2, None, 1.0, 1]]  # two blanks to fill
    rows += [[-3, 1e6, -5.0, 0], [-4, None, -5.0, 1]]  # quarantined (range on b): neither counts
    src = _csv(tmp_path / "m.csv", ["id", "a", "b", "y"], rows)
    checks = ValidationSpec.model_validate(
        {"columns": {"a": {"type": "float", "impute": "median"}, "b": {"type": "float", "min": 0}}}
    )
    version = ingest(src, "m", IngestOptions(label_column="y", checks=checks))
    imputed = version.manifest["recipe"]["imputed"]["a"]
    assert imputed == {"how": "median", "value": float(np.median(a)), "rows": 2}
    assert version.manifest["quarantine"]["by_reason"] == {"range:b": 2}
    filled = version.to_numpy(["a"])["a"]
    assert (filled == float(np.median(a))).sum() >= 2 and filled.max() < 1e6


def test_mean_and_mode_use_kept_rows_and_the_summary_names_them(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows: list[list[object]] = [[1.0, 2, 0], [3.0, 2, 0], [None, None, None], [5.0, 7, 3]]
    rows += [[1000.0, 7, 3], [1000.0, 7, 3], [1000.0, 7, 3]]  # duplicates: quarantined
    src = _csv(tmp_path / "s.csv", ["v", "k", "c"], rows)
    checks = tmp_path / "checks.yaml"
    checks.write_text(
        "columns:\n  v: {type: float, impute: mean}\n  k: {type: int, impute: median}\n"
        "  c: {type: int, impute: mode}\n"
    )
    argv = ["data", "ingest", str(src), "--name", "s", "--checks", str(checks), "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    doc = json.loads(out)
    got = {d["column"]: (d["how"], d["value"], d["rows"]) for d in doc["imputed"]}
    # Kept rows: v 1, 3, 5, 1000 (one of the three copies); k 2, 2, 7, 7 (median 4.5 -> 5); c 0 0 3 3.
    assert got == {"v": ("mean", 252.25, 1), "k": ("median", 5, 1), "c": ("mode", 0, 1)}
    assert doc["quarantine"] == {"duplicate": 2}
    code, out, _ = _run(capsys, "data", "show", "s")
    assert code == 0 and "imputed column 'v': mean = 252.25 into 1 row(s)" in out
    # A split made after ingest's imputation says that its test rows took part in the statistic.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("split: {seed: 0, fractions: {train: 0.5, test: 0.5}}\n")
    code, out, err = _run(capsys, "data", "transform", "s", "--recipe", str(recipe), "--engine", "serial")
    lines = [ln for ln in err.splitlines() if "warning" in ln]
    assert code == 0 and len(lines) == 1 and "c (mode), k (median), v (mean)" in lines[0], err
    assert "imputed at ingest from all rows" in lines[0]


def test_a_repeated_header_row_is_one_line_naming_the_row(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(1)
    names = [f"x_{i:02d}" for i in range(30)] + ["label"]
    rows: list[list[object]] = [
        [*(round(float(v), 3) for v in rng.normal(size=30)), i % 3] for i in range(60)
    ]
    rows.insert(40, list(names))  # a second file's header, concatenated
    src = _csv(tmp_path / "h.csv", names, rows)
    argv = ["data", "ingest", str(src), "--name", "h", "--label-column", "label", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    doc = json.loads(out)
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "row 40" in warnings[0] and "header" in warnings[0], err
    assert doc["quarantine"] == {"header": 1} and doc["rows"] == 60
    assert all(r["type"] == "float" and not r["warnings"] for r in doc["schema"] if r["column"] != "label")
    code, out, _ = _run(capsys, "data", "quarantine", "h", "--json")
    q = json.loads(out)["rows"]
    assert [(r["row"], r["reason"]) for r in q] == [(40, "header")]
