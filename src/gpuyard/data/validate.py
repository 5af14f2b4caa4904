"""Cleaning and validation: schema, types, nulls, duplicates, ranges and label sets.

Nothing is dropped silently: each failing row goes to the quarantine with the first reason it failed
(``null:age``, ``range:age``, ``type:age``, ``label``, ``duplicate``, ``image``) and its values as
read (a bad ``"n/a"`` stays ``"n/a"``), and ``rows_in == rows_kept + rows_quarantined`` always holds
(checked before a version is recorded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.data.columns import column_kind
from gpuyard.data.infer import INTEGER_RE as _INTEGER_RE
from gpuyard.data.infer import NUMBER_RE as _NUMBER_RE
from gpuyard.errors import ConfigError, IntegrityError

_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
QUARANTINE_SCHEMA = pa.schema([("row", pa.int64()), ("reason", pa.string()), ("values", pa.string())])


class ColumnCheck(BaseModel):
    """Checks on one column (YAML: ``columns: {age: {type: float, min: 0, impute: median}}``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["int", "float", "str", "bool"] | None = None
    nullable: bool = False
    min: float | None = None
    max: float | None = None
    allowed: list[Any] | None = None
    impute: Literal["mean", "median", "mode"] | float | int | str | None = None


class ValidationSpec(BaseModel):
    """What a clean row looks like. Columns not named here are only checked for nulls (``nulls``)."""

    model_config = ConfigDict(extra="forbid")

    columns: dict[str, ColumnCheck] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list, description="columns that must exist")
    nulls: Literal["quarantine", "keep"] = "quarantine"
    duplicates: Literal["quarantine", "keep"] = "quarantine"
    label_column: str | None = None
    labels: list[Any] | None = Field(default=None, description="the declared label set")


@dataclass
class Cleaned:
    """Result of validation: kept rows, quarantined rows (row, reason, values) and counts."""

    kept: pa.Table
    quarantine: pa.Table
    rows_in: int
    by_reason: dict[str, int]
    imputed: dict[str, dict[str, Any]] = field(default_factory=dict)


def check_schema(schema: pa.Schema, spec: ValidationSpec) -> None:
    """Fail before any work when the spec names a column the data does not have."""
    names = set(schema.names)
    wanted = set(spec.required) | set(spec.columns) | ({spec.label_column} if spec.label_column else set())
    missing = sorted(wanted - names)
    if missing:
        raise ConfigError(
            f"column(s) {', '.join(missing)} not in the data (columns: {', '.join(schema.names)})"
        )


def clean(
    table: pa.Table,
    spec: ValidationSpec,
    extra_bad: dict[int, str] | None = None,
    inferred: dict[str, str] | None = None,
) -> Cleaned:
    """Apply ``spec`` to ``table``; ``extra_bad`` maps row indices already known bad to a reason.

    ``inferred`` maps text columns to the numeric type inference chose for them (``int``/``float``,
    see :mod:`gpuyard.data.infer`); they are converted as a type in the checks would be. Quarantined
    rows keep their values as read, before any conversion or imputation (``"unknown"``, not null).
    """
    check_schema(table.schema, spec)
    raw = table
    n = table.num_rows
    reasons = _Reasons(n)
    for idx, why in (extra_bad or {}).items():
        reasons.mark_one(idx, why)
    table = _coerce_types(table, spec, reasons, inferred)
    # Every check first (an imputed column's blanks are not failures: they are filled below), so the
    # imputed value is computed from the rows that are kept, never from a quarantined one.
    for name in table.column_names:
        check = spec.columns.get(name)
        _check_column(
            table, name, check, spec, reasons, nulls_filled=check is not None and check.impute is not None
        )
    if spec.label_column and spec.labels is not None:
        allowed = pa.array([str(v) for v in spec.labels])
        ok = pc.is_in(pc.cast(table.column(spec.label_column), pa.string()), value_set=allowed)
        _mark(reasons, ~_np(ok), "label")
    if spec.duplicates == "quarantine" and n:
        _mark_duplicates(table, reasons)
    table, imputed = _impute(table, spec, reasons.codes == 0)
    for name in imputed:  # a constant fill value must pass the column's own checks too
        _check_column(table, name, spec.columns.get(name), spec, reasons)
    bad = reasons.codes > 0
    kept = table.filter(pa.array(~bad))
    quarantine = _quarantine_table(raw, bad, reasons)
    by_reason = reasons.counts()
    if kept.num_rows + quarantine.num_rows != n:
        raise IntegrityError(f"row accounting broke: {n} in, {kept.num_rows} kept, {quarantine.num_rows} out")
    return Cleaned(kept=kept, quarantine=quarantine, rows_in=n, by_reason=by_reason, imputed=imputed)


def _np(mask: pa.ChunkedArray | pa.Array) -> np.ndarray:
    # Nulls in a boolean mask mean "not this reason"; they are caught by the null check.
    return np.asarray(pc.fill_null(mask, True).to_numpy(zero_copy_only=False), dtype=bool)


class _Reasons:
    """First failure reason per row, as small integer codes (fast on millions of rows)."""

    def __init__(self, n: int) -> None:
        self.codes = np.zeros(n, dtype=np.int32)
        self.names: list[str] = []

    def _code(self, why: str) -> int:
        if why not in self.names:
            self.names.append(why)
        return self.names.index(why) + 1

    def mark(self, bad: np.ndarray, why: str) -> None:
        fresh = bad & (self.codes == 0)
        if fresh.any():
            self.codes[fresh] = self._code(why)

    def mark_one(self, idx: int, why: str) -> None:
        if self.codes[idx] == 0:
            self.codes[idx] = self._code(why)

    def reason(self, idx: int) -> str:
        return self.names[self.codes[idx] - 1]

    def counts(self) -> dict[str, int]:
        found = np.bincount(self.codes, minlength=len(self.names) + 1)
        return {name: int(found[i + 1]) for i, name in enumerate(self.names) if found[i + 1]}


def _mark(reasons: _Reasons, bad: np.ndarray, why: str) -> None:
    reasons.mark(bad, why)


def _coerce_types(
    table: pa.Table, spec: ValidationSpec, reasons: _Reasons, inferred: dict[str, str] | None = None
) -> pa.Table:
    wanted: dict[str, str] = {n: c.type for n, c in spec.columns.items() if c.type is not None}
    for name, kind in (inferred or {}).items():
        wanted.setdefault(name, kind)  # a type in the checks wins over inference
    for name, kind in wanted.items():
        col, target = table.column(name), _TYPES[kind]
        if col.type == target:
            continue
        if column_kind(table.schema.field(name)) == "string" and kind in ("int", "float"):
            # Text in a numeric column (a CSV cell like "n/a"): quarantine the row, keep the rest.
            col = _text_to_number(col, kind, name, reasons)
        else:
            try:
                col = pc.cast(col, target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ConfigError(f"column {name!r} ({col.type}) cannot be read as {kind}: {exc}") from exc
        table = table.set_column(table.schema.get_field_index(name), name, col)
    return table


def _text_to_number(col: pa.ChunkedArray, kind: str, name: str, reasons: _Reasons) -> pa.Array:
    """A text column as int64 or float64; the rows whose value is not such a number are marked bad.

    Blank cells are nulls (the null check decides about them); ``int`` takes whole numbers only
    (``3`` or ``3.0``, not ``2.5``): nothing is truncated or rounded.
    """
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.string())
    text = pc.utf8_trim_whitespace(col.combine_chunks())
    text = pc.if_else(pc.equal(text, ""), pa.scalar(None, text.type), text)
    is_null = np.asarray(text.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    ok = _np(pc.match_substring_regex(text, _NUMBER_RE)) | is_null
    numbers = pc.cast(pc.if_else(pa.array(ok), text, pa.scalar(None, text.type)), pa.float64())
    if kind == "int":
        values = np.asarray(numbers.to_numpy(zero_copy_only=False), dtype=np.float64)
        with np.errstate(invalid="ignore"):
            ok &= is_null | (np.floor(values) == values)
    _mark(reasons, ~ok, f"type:{name}")
    if kind == "float":
        return numbers
    good = pc.if_else(pa.array(ok), text, pa.scalar(None, text.type))
    if bool(pc.all(pc.match_substring_regex(pc.drop_null(good), _INTEGER_RE)).as_py() is not False):
        try:  # exact, also beyond 2**53
            return pc.cast(pc.replace_substring_regex(good, r"^\+", ""), pa.int64())
        except pa.ArrowInvalid:
            pass  # beyond int64: through float64 below, which the cast refuses if it loses the value
    try:
        return pc.cast(pc.if_else(pa.array(ok), numbers, pa.scalar(None, pa.float64())), pa.int64())
    except pa.ArrowInvalid as exc:
        raise ConfigError(f"column {name!r} holds whole numbers beyond int64; declare it float") from exc


def _impute(
    table: pa.Table, spec: ValidationSpec, keep: np.ndarray
) -> tuple[pa.Table, dict[str, dict[str, Any]]]:
    """Fill the blanks of each column with an ``impute`` rule; ``keep``: the rows not quarantined.

    Statistics are exact and computed over the kept rows' values only (a quarantined row never moves
    a mean, median or mode); ``rows`` counts the kept rows that were filled.
    """
    imputed: dict[str, dict[str, Any]] = {}
    mask = pa.array(keep)
    for name, check in spec.columns.items():
        col = table.column(name)
        if check.impute is None or col.null_count == 0:
            continue
        how = check.impute
        kept = pc.filter(col, mask)
        present = pc.drop_null(kept)
        rows = int(kept.null_count)
        if rows == 0:
            continue  # the blanks are all in quarantined rows: nothing kept is filled
        if how in ("mean", "median") and not (
            pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
        ):
            raise ConfigError(f"column {name!r} ({col.type}): impute {how!r} needs numbers")
        if how in ("mean", "median", "mode") and len(present) == 0:
            raise ConfigError(f"column {name!r}: cannot impute {how!r}, every kept value is null")
        if how == "mean":
            value: Any = float(np.mean(np.asarray(present.to_numpy(zero_copy_only=False), dtype=np.float64)))
        elif how == "median":
            # Exact (numpy's median: the middle value, or the mean of the two middle ones).
            value = float(np.median(np.asarray(present.to_numpy(zero_copy_only=False), dtype=np.float64)))
        elif how == "mode":
            modes = pc.mode(present)
            value = modes[0]["mode"].as_py()
        else:
            value = how
        if pa.types.is_integer(col.type) and isinstance(value, float):
            value = int(np.floor(value + 0.5))  # half up: the median of 2 and 3 fills 3, not 2
        imputed[name] = {"how": str(how), "value": value, "rows": rows}
        filled = pc.fill_null(col, pa.scalar(value).cast(col.type))
        table = table.set_column(table.schema.get_field_index(name), name, filled)
    return table, imputed


def _check_column(
    table: pa.Table,
    name: str,
    check: ColumnCheck | None,
    spec: ValidationSpec,
    reasons: _Reasons,
    nulls_filled: bool = False,
) -> None:
    col = table.column(name)
    nullable = nulls_filled or (check.nullable if check is not None else spec.nulls == "keep")
    if not nullable and col.null_count:
        _mark(reasons, np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool), f"null:{name}")
    if check is None:
        return
    if check.min is not None:
        _mark(reasons, ~_np(pc.greater_equal(col, check.min)), f"range:{name}")
    if check.max is not None:
        _mark(reasons, ~_np(pc.less_equal(col, check.max)), f"range:{name}")
    if check.allowed is not None:
        allowed = pa.array([str(v) for v in check.allowed])
        _mark(reasons, ~_np(pc.is_in(pc.cast(col, pa.string()), value_set=allowed)), f"allowed:{name}")


def _mark_duplicates(table: pa.Table, reasons: _Reasons) -> None:
    # The first occurrence is kept; later copies are quarantined as "duplicate".
    idx = pa.array(np.arange(table.num_rows, dtype=np.int64))
    keys = [c for c in table.column_names if column_kind(table.schema.field(c)) != "other"]
    if not keys:
        return
    grouped = table.select(keys).append_column("__row", idx).group_by(keys, use_threads=False)
    first = grouped.aggregate([("__row", "min")]).column("__row_min").to_numpy()
    dup = np.ones(table.num_rows, dtype=bool)
    dup[first] = False
    _mark(reasons, dup, "duplicate")


def _quarantine_table(table: pa.Table, bad: np.ndarray, reasons: _Reasons) -> pa.Table:
    rows = np.flatnonzero(bad)
    if rows.size == 0:
        return QUARANTINE_SCHEMA.empty_table()
    plain = [c for c in table.column_names if column_kind(table.schema.field(c)) != "tensor"]
    values = table.select(plain).take(pa.array(rows)).to_pylist()
    return pa.table(
        {
            "row": pa.array(rows, pa.int64()),
            "reason": pa.array([reasons.reason(int(i)) for i in rows], pa.string()),
            "values": pa.array([json.dumps(v, default=str) for v in values], pa.string()),
        },
        schema=QUARANTINE_SCHEMA,
    )
