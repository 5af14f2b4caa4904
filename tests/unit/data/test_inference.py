"""Type inference never degrades a column silently; the quarantine keeps values as the file held them.

A numeric CSV column with a few stray words stays numeric (those rows quarantined with their text);
a column that is mostly but not nearly all numbers stays text with a warning; empty sources and binary
files are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuyard.cli.main import main
from gpuyard.data import IngestOptions, ValidationSpec, ingest
from gpuyard.data.infer import NUMERIC_SHARE, guess_column
from gpuyard.data.validate import ColumnCheck, clean
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit

STRAY = {3: "unknown", 40: "n/a?", 77: "refused", 150: "ask later"}


def _people_csv(path: Path, rows: int = 200, stray: dict[int, str] | None = None) -> Path:
    """age,income,score,label with ``stray`` words in income at the given rows."""
    stray = STRAY if stray is None else stray
    lines = ["age,income,score,label"]
    for i in range(rows):
        income = stray.get(i, str(30000 + 97 * i))
        lines.append(f"{20 + i % 50},{income},{(i % 17) / 10:.1f},{i % 2}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# The rule, on one column.


def test_a_few_words_among_numbers_keep_a_column_numeric() -> None:
    values = [str(i) for i in range(96)] + ["unknown", "n/a?", "refused", "ask later"]
    g = guess_column(pa.array(values))
    assert g.type == "int" and g.values == 100 and g.numbers == 96 and g.bad == 4
    assert g.examples == ["unknown", "n/a?", "refused"]
    assert "quarantined as type:income" in (g.warning("income") or "")


def test_below_the_share_a_column_stays_text_with_a_warning() -> None:
    values = [str(i) for i in range(90)] + [f"A{i}" for i in range(10)]
    g = guess_column(pa.array(values))
    assert g.type is None and g.share == pytest.approx(0.90) and g.share < NUMERIC_SHARE
    warning = g.warning("code") or ""
    assert "90.0% of values are numbers" in warning and "type: float" in warning
    assert guess_column(pa.array(["red", "blue", "1"])).warning("c") is None  # plain text: no warning


def test_floats_blanks_signs_and_huge_integers() -> None:
    assert guess_column(pa.array(["1.5", " 2 ", "+3", "-4e2", None, "", "  "])).type == "float"
    g = guess_column(pa.array(["+1", " 2", "-3", None]))
    assert g.type == "int" and g.values == 3
    assert guess_column(pa.array(["1", "99999999999999999999999"])).type == "float"  # beyond int64
    assert guess_column(pa.array([None, ""], pa.string())).values == 0


# Cleaning with an inferred type, and raw values in the quarantine.


def test_inferred_rows_go_to_the_quarantine_with_the_raw_value() -> None:
    table = pa.table({"income": ["10", " 20", "unknown", "+30", None], "y": [1, 2, 3, 4, 5]})
    out = clean(table, ValidationSpec(nulls="keep"), inferred={"income": "int"})
    assert out.kept.column("income").type == pa.int64()
    assert out.kept.column("income").to_pylist() == [10, 20, 30, None]
    assert out.by_reason == {"type:income": 1}
    assert out.kept.num_rows + out.quarantine.num_rows == out.rows_in == 5
    values = json.loads(out.quarantine.column("values")[0].as_py())
    assert values == {"income": "unknown", "y": 3}  # what the file held, not null


def test_a_declared_type_keeps_the_raw_value_and_never_truncates() -> None:
    table = pa.table({"n": ["1", "2.5", "3.0", "lots", " 4 "]})
    out = clean(table, ValidationSpec(columns={"n": ColumnCheck(type="int")}))
    q = {r["row"]: json.loads(r["values"])["n"] for r in out.quarantine.to_pylist()}
    assert q == {1: "2.5", 3: "lots"}  # 2.5 is not an int: quarantined, not cut to 2
    assert out.kept.column("n").to_pylist() == [1, 3, 4]


# Ingest end to end.


def test_ingest_keeps_income_numeric_and_accounts_for_every_row(gpuyard_home: Path, tmp_path: Path) -> None:
    v = ingest(_people_csv(tmp_path / "people.csv"), "people", IngestOptions(label_column="label"))
    kinds = {c["name"]: c["kind"] for c in v.manifest["schema"]}
    assert kinds["income"] == "int"
    q = v.manifest["quarantine"]
    assert (q["rows_in"], q["rows_kept"], q["rows_quarantined"]) == (200, 196, 4)
    assert q["by_reason"] == {"type:income": 4}
    rows = v.quarantine().to_pylist()
    assert {r["row"]: json.loads(r["values"])["income"] for r in rows} == STRAY
    inferred = v.manifest["recipe"]["inference"]["columns"]["income"]
    assert inferred["type"] == "int" and inferred["numbers"] == 196


def test_checks_decide_over_inference(gpuyard_home: Path, tmp_path: Path) -> None:
    spec = ValidationSpec(columns={"income": ColumnCheck(type="str")})
    v = ingest(_people_csv(tmp_path / "p.csv"), "p", IngestOptions(label_column="label", checks=spec))
    assert {c["name"]: c["kind"] for c in v.manifest["schema"]}["income"] == "string"
    assert v.manifest["quarantine"]["rows_quarantined"] == 0


def test_typed_sources_are_not_inferred(gpuyard_home: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"code": [str(i) for i in range(50)] + ["x"], "y": list(range(51))}), src)
    v = ingest(src, "t", IngestOptions(label_column="y"))
    assert {c["name"]: c["kind"] for c in v.manifest["schema"]}["code"] == "string"
    js = tmp_path / "t.jsonl"
    js.write_text("".join(f'{{"zip": "0{i:04d}", "y": {i}}}\n' for i in range(30)))
    v = ingest(js, "j", IngestOptions(label_column="y"))
    assert {c["name"]: c["kind"] for c in v.manifest["schema"]}["zip"] == "string"  # quoted: meant as text


def test_one_bad_value_in_many_is_never_shown_as_100_percent() -> None:
    g = guess_column(pa.array([str(i) for i in range(5000)] + ["oops"]))
    assert g.type == "int" and ">99.9% of values are numbers" in (g.warning("n") or "")


def test_empty_sources_are_refused(gpuyard_home: Path, tmp_path: Path) -> None:
    from gpuyard.data import list_datasets

    src = tmp_path / "h.csv"
    src.write_text("a,b,label\n")
    with pytest.raises(ConfigError, match="only a header"):
        ingest(src, "h")
    src.write_text("a,label\n,1\n,2\n")
    with pytest.raises(ConfigError, match=r"all 2 rows were quarantined \(null:a=2\)"):
        ingest(src, "h")
    src.write_text("")
    with pytest.raises(ConfigError, match=r"is empty \(0 bytes\)"):
        ingest(src, "h")
    assert list_datasets() == []  # nothing recorded


# The CLI: summary, JSON, one-line refusals with exit code 2.


def test_cli_ingest_prints_the_schema_summary_with_warnings(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _people_csv(tmp_path / "people.csv")
    text = src.read_text().splitlines()
    text[0] += ",code"
    text[1:] = [f"{line},{'A' if i % 5 == 0 else ''}{i}" for i, line in enumerate(text[1:])]
    src.write_text("\n".join(text) + "\n")
    code, out, err = _run(capsys, "data", "ingest", str(src), "--name", "people", "--label-column", "label")
    assert code == 0
    assert "column" in out and "nulls" in out and "warnings" in out
    assert "quarantined as type:income" in " ".join(out.split())
    code, out, err = _run(
        capsys, "data", "ingest", str(src), "--name", "people", "--label-column", "label", "--json"
    )
    assert code == 0
    schema = {r["column"]: r for r in json.loads(out)["schema"]}
    assert schema["income"]["type"] == "int" and schema["income"]["nulls"] == 0
    assert "4 row(s) with text quarantined" in schema["income"]["warnings"][0]
    assert (
        schema["code"]["type"] == "string" and "80.0% of values are numbers" in schema["code"]["warnings"][0]
    )
    assert schema["age"]["warnings"] == []
    assert "warning: column 'code'" in err  # also said on stderr, where --json leaves room
    code, out, _ = _run(capsys, "data", "show", "people")
    assert code == 0 and "warning: column 'code': kept as text" in " ".join(out.split())


def test_cli_refuses_a_header_only_csv_in_one_line(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "h.csv"
    src.write_text("a,b,label\n")
    code, out, err = _run(capsys, "data", "ingest", str(src), "--name", "h", "--json")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "only a header" in err
    code, out, _ = _run(capsys, "data", "ls", "--json")
    assert json.loads(out) == []


def test_cli_refuses_binary_csv_and_yaml_in_one_line(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = bytes(range(256)) * 64  # NUL bytes, newlines and invalid UTF-8 alike
    bad_csv = tmp_path / "blob.csv"
    bad_csv.write_bytes(blob)
    code, _, err = _run(capsys, "data", "ingest", str(bad_csv), "--name", "b")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "binary file, not CSV text" in err
    latin = tmp_path / "latin.csv"
    latin.write_bytes("name,label\nJos\xe9,1\n".encode("latin-1"))
    code, _, err = _run(capsys, "data", "ingest", str(latin), "--name", "b")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not UTF-8" in err
    good = _people_csv(tmp_path / "people.csv")
    bad_yaml = tmp_path / "checks.yaml"
    bad_yaml.write_bytes(b"columns:\n" + blob)
    code, _, err = _run(capsys, "data", "ingest", str(good), "--name", "b", "--checks", str(bad_yaml))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "binary file, not YAML text" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("columns:\n  age: {type: float\n")
    code, _, err = _run(capsys, "data", "ingest", str(good), "--name", "b", "--checks", str(broken))
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{broken}:3:1:" in " ".join(err.split())


def test_cli_quarantine_shows_the_raw_value(
    gpuyard_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _people_csv(tmp_path / "people.csv")
    code, out, _ = _run(capsys, "data", "ingest", str(src), "--name", "people", "--json")
    assert code == 0
    code, out, _ = _run(capsys, "data", "quarantine", json.loads(out)["ref"], "--json")
    doc = json.loads(out)
    assert doc["rows_kept"] + doc["rows_quarantined"] == doc["rows_in"] == 200
    assert sorted(r["values"]["income"] for r in doc["rows"]) == sorted(STRAY.values())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(-(10**12), 10**12).map(str),
            st.sampled_from(["unknown", "n/a?", "1,000", "$5", "2.5", "-", "12abc"]),
            st.none(),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_any_mix_accounts_for_every_row_and_keeps_raw_text(values: list[str | None]) -> None:
    table = pa.table({"v": pa.array(values, pa.string()), "i": list(range(len(values)))})
    out = clean(table, ValidationSpec(nulls="keep", duplicates="keep"), inferred={"v": "int"})
    assert out.kept.num_rows + out.quarantine.num_rows == out.rows_in == len(values)
    bad = {i: v for i, v in enumerate(values) if v is not None and not v.lstrip("-").isdigit()}
    quarantined = {r["row"]: json.loads(r["values"])["v"] for r in out.quarantine.to_pylist()}
    assert quarantined == bad  # exactly the non-integers, each as the file held it
    kept = [None if v is None else int(v) for i, v in enumerate(values) if i not in bad]
    assert out.kept.column("v").to_pylist() == kept
