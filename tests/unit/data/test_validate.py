"""Cleaning and validation: every bad row lands in the quarantine with its reason, and counts add up."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuyard.data.validate import ColumnCheck, ValidationSpec, check_schema, clean
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.integers(-50, 250)), st.sampled_from(["a", "b", "c", "zzz"])),
        min_size=0,
        max_size=40,
    )
)
def test_rows_in_equal_kept_plus_quarantined(rows: list[tuple[int | None, str]]) -> None:
    table = pa.table({"age": pa.array([r[0] for r in rows], pa.int64()), "label": [r[1] for r in rows]})
    spec = ValidationSpec(
        columns={"age": ColumnCheck(min=0, max=130)}, label_column="label", labels=["a", "b", "c"]
    )
    out = clean(table, spec)
    assert out.kept.num_rows + out.quarantine.num_rows == out.rows_in == len(rows)
    assert sum(out.by_reason.values()) == out.quarantine.num_rows
    # Nothing bad survives, and every good, first-seen row does.
    seen: set[tuple[int | None, str]] = set()
    expected = []
    for age, label in rows:
        good = age is not None and 0 <= age <= 130 and label != "zzz" and (age, label) not in seen
        seen.add((age, label))
        if good:
            expected.append(age)
    assert out.kept.column("age").to_pylist() == expected


def test_reasons_types_and_imputation() -> None:
    table = pa.table(
        {
            "age": ["34", "n/a-ish", "29", "200", None, "41"],
            "height": [1.8, None, 1.7, 1.6, 1.9, None],
            "label": ["y", "n", "y", "n", "y", "q"],
        }
    )
    spec = ValidationSpec(
        columns={
            "age": ColumnCheck(type="float", min=0, max=130),
            "height": ColumnCheck(impute="median"),
        },
        label_column="label",
        labels=["y", "n"],
    )
    out = clean(table, spec)
    q = out.quarantine
    reasons = dict(zip(q.column("row").to_pylist(), q.column("reason").to_pylist(), strict=True))
    assert reasons == {1: "type:age", 3: "range:age", 4: "null:age", 5: "label"}
    assert out.kept.column("age").type == pa.float64()
    assert out.kept.column("height").null_count == 0
    # Both blank heights are in quarantined rows (1: type, 5: label): no kept row was filled.
    assert "height" not in out.imputed
    values = json.loads(out.quarantine.column("values")[0].as_py())
    assert values == {"age": "n/a-ish", "height": None, "label": "n"}  # as read: raw text, not imputed


def test_duplicates_keep_the_first_copy() -> None:
    table = pa.table({"x": [1, 2, 1, 1, 3], "y": ["a", "b", "a", "c", "c"]})
    out = clean(table, ValidationSpec())
    assert out.quarantine.column("row").to_pylist() == [2]
    assert out.by_reason == {"duplicate": 1}
    kept_all = clean(table, ValidationSpec(duplicates="keep"))
    assert kept_all.kept.num_rows == 5


def test_unknown_column_is_refused_before_work() -> None:
    table = pa.table({"x": [1, 2]})
    with pytest.raises(ConfigError, match="agee"):
        check_schema(table.schema, ValidationSpec(columns={"agee": ColumnCheck(min=0)}))
    with pytest.raises(ConfigError, match="lbl"):
        clean(table, ValidationSpec(label_column="lbl"))


def test_nulls_keep_mode_keeps_unchecked_nulls() -> None:
    table = pa.table({"x": pa.array([1.0, None, np.nan])})
    assert clean(table, ValidationSpec(nulls="keep")).kept.num_rows == 3
    assert clean(table, ValidationSpec()).by_reason == {"null:x": 1}
