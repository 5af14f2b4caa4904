"""Column type inference for CSV sources that never degrades a column silently.

The reader guesses each column's type from its values, and one stray word ("unknown") among thousands
of numbers makes it text: every number becomes a string and a model then cannot use the column. The
rule here, applied after reading and before validation:

- A text column whose non-empty values are **at least 95 % numbers** (``NUMERIC_SHARE``) is numeric:
  ``int`` when every number is an integer, else ``float``. The values that are not numbers go to the
  quarantine with reason ``type:<column>`` and the value as the file held it; every other row stays.
- A text column with at least half of its values numbers (``MOSTLY_NUMERIC``) but below 95 % stays
  text, with a warning naming the share and a few of the non-numbers: declare the type in ``--checks``
  to make it numeric (and quarantine the rest), or leave it text.
- A column with a type in the checks file is never inferred: the checks decide.

Why a share rather than a count: three bad values are noise among a million numbers and a text column
among ten values; a share scales with the file, and it bounds what inference can send to the quarantine
(at most 5 % of a column's rows), which the schema summary then reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpuyard.data.columns import column_kind

NUMBER_RE = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"
INTEGER_RE = r"^\s*[-+]?\d+\s*$"
# At least this share of a column's non-empty values must be numbers for it to be numeric.
NUMERIC_SHARE = 0.95
# A text column with at least this share of numbers gets a warning ("mostly numeric").
MOSTLY_NUMERIC = 0.5
# Non-numbers quoted in a warning.
EXAMPLES = 3
# Only CSV is inferred: its cells are untyped text. JSON types its values (a quoted "00123" is meant
# as text, and a field mixing numbers and strings is refused by the reader); Parquet and NumPy files
# carry their writer's types.
TEXT_FORMATS = ("csv",)


@dataclass(frozen=True)
class ColumnGuess:
    """What inference found in one text column.

    Attributes:
        values: non-empty values.
        numbers: how many of them are numbers.
        type: ``int`` or ``float`` when the column becomes numeric, else None (it stays text).
        examples: a few of the values that are not numbers, as the file held them.
    """

    values: int
    numbers: int
    type: str | None
    examples: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        """Share of the non-empty values that are numbers."""
        return self.numbers / self.values if self.values else 0.0

    @property
    def percent(self) -> str:
        """The share as a percentage that never rounds up to 100 % while a value is not a number."""
        text = f"{self.share:.1%}"
        return ">99.9%" if text == "100.0%" and self.bad else text

    @property
    def bad(self) -> int:
        """Non-empty values that are not numbers."""
        return self.values - self.numbers

    def warning(self, name: str) -> str | None:
        """The warning the schema summary shows for this column, or None."""
        quoted = ", ".join(repr(x) for x in self.examples)
        if self.type is not None and self.bad:
            return (
                f"inferred {self.type}: {self.percent} of values are numbers; {self.bad} row(s) with "
                f"text quarantined as type:{name} (e.g. {quoted})"
            )
        if self.type is None and self.share >= MOSTLY_NUMERIC:
            return (
                f"kept as text although {self.percent} of values are numbers (below "
                f"{NUMERIC_SHARE:.0%}; e.g. {quoted}): a model will not use it; declare "
                f"'columns: {{{name}: {{type: float}}}}' in --checks to make it numeric"
            )
        return None

    def to_json(self) -> dict[str, Any]:
        """The form stored in the manifest's recipe."""
        return {
            "values": self.values,
            "numbers": self.numbers,
            "type": self.type,
            "examples": self.examples,
        }


def guess_column(col: pa.ChunkedArray | pa.Array) -> ColumnGuess:
    """Apply the rule (module docstring) to one text column."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.string())
    present = pc.drop_null(col)
    if len(present) == 0:
        return ColumnGuess(0, 0, None)
    blank = _np(pc.match_substring_regex(present, r"^\s*$"))
    present = present.filter(pa.array(~blank))
    n = len(present)
    if n == 0:
        return ColumnGuess(0, 0, None)
    is_num = _np(pc.match_substring_regex(present, NUMBER_RE))
    numbers = int(is_num.sum())
    examples = [str(x) for x in present.filter(pa.array(~is_num)).slice(0, EXAMPLES).to_pylist()]
    if numbers == 0 or numbers / n < NUMERIC_SHARE:
        return ColumnGuess(n, numbers, None, examples)
    ints = present.filter(pa.array(is_num))
    kind = "int" if bool(pc.all(pc.match_substring_regex(ints, INTEGER_RE)).as_py()) else "float"
    if kind == "int" and not _fits_int64(ints):
        kind = "float"
    return ColumnGuess(n, numbers, kind, examples)


def infer_types(table: pa.Table, fmt: str, declared: set[str]) -> dict[str, ColumnGuess]:
    """Guesses for the text columns of ``table`` read from a ``fmt`` source.

    Only CSV is inferred (``TEXT_FORMATS``); columns in ``declared`` (a type in the checks) are left
    to the checks.
    """
    if fmt not in TEXT_FORMATS:
        return {}
    out: dict[str, ColumnGuess] = {}
    for fld in table.schema:
        if fld.name in declared or column_kind(fld) != "string":
            continue
        guess = guess_column(table.column(fld.name))
        if guess.type is not None or guess.share >= MOSTLY_NUMERIC:
            out[fld.name] = guess
    return out


def schema_summary(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per column of a version: name, kind, nulls and warnings (inference, empty columns)."""
    stats = manifest.get("stats") or {}
    recipe = manifest.get("recipe") or {}
    inferred = (recipe.get("inference") or {}).get("columns") or {}
    by_reason = (manifest.get("quarantine") or {}).get("by_reason") or {}
    rows: list[dict[str, Any]] = []
    for col in manifest["schema"]:
        name = str(col["name"])
        s = stats.get(name, {})
        warnings: list[str] = []
        if name in inferred:
            g = inferred[name]
            guess = ColumnGuess(
                int(g["values"]), int(g["numbers"]), g.get("type"), list(g.get("examples", []))
            )
            text = guess.warning(name)
            if text:
                warnings.append(text)
        if col.get("kind") == "other" and col.get("type") != "null":  # null: "every value is empty"
            warnings.append(f"type {col.get('type')} is neither a number, text nor a tensor")
        count, nulls = int(s.get("count", 0)), int(s.get("nulls", 0))
        if count and nulls == count:
            warnings.append("every value is empty")
        declared_bad = by_reason.get(f"type:{name}", 0)
        if declared_bad and name not in inferred:
            warnings.append(f"{declared_bad} row(s) quarantined as type:{name}")
        rows.append({"column": name, "type": col.get("kind"), "nulls": nulls, "warnings": warnings})
    return rows


def _np(mask: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def _fits_int64(values: pa.ChunkedArray | pa.Array) -> bool:
    try:
        pc.cast(pc.replace_substring_regex(pc.utf8_trim_whitespace(values), r"^\+", ""), pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True
