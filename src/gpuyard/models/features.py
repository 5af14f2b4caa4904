"""Which columns a fit, cross-validation or search trains on, and which it leaves out and why.

A model takes numbers: the features of a gpuyard dataset version are its tensor, int, float and bool
columns (:func:`gpuyard.data.arrays.feature_columns`). Every other column except the label and the
bookkeeping columns (``split``, ``fold``) is left out, and nothing is left out silently: the usage is
returned with each result, printed by ``gpuyard models fit``, ``gpuyard cv`` and ``gpuyard tune`` (a
warning line per column left out, on stderr), and recorded on the run as the tags
``features`` and ``dropped_features``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuyard.models.datasets import Dataset


@dataclass(frozen=True)
class FeatureUsage:
    """The columns behind X, and the columns left out with the reason for each.

    Attributes:
        used: feature columns in the order of X's columns (a tensor column counts once).
        dropped: column -> why it is not a feature.
        label: the label column, when the dataset names one.
        width: columns of X (tensor columns count their elements).
    """

    used: tuple[str, ...]
    dropped: dict[str, str] = field(default_factory=dict)
    label: str | None = None
    width: int = 0
    # One-line warnings about the data beside the columns (a spec's split ignored for the split of record).
    notes: tuple[str, ...] = ()

    def with_notes(self, *notes: str | None) -> FeatureUsage:
        """This usage with ``notes`` (None ones skipped) added to its warnings."""
        extra = tuple(n for n in notes if n)
        return dataclasses.replace(self, notes=self.notes + extra) if extra else self

    def to_json(self) -> dict[str, Any]:
        """The form returned in results and printed with --json (``notes`` only when there are some)."""
        doc: dict[str, Any] = {
            "used": list(self.used),
            "dropped": dict(self.dropped),
            "label": self.label,
            "width": self.width,
        }
        if self.notes:
            doc["notes"] = list(self.notes)
        return doc

    def run_tags(self) -> dict[str, Any]:
        """The run tags fit, cv and tune record: ``features``, and ``dropped_features`` when any."""
        return {
            "features": list(self.used),
            **({"dropped_features": dict(self.dropped)} if self.dropped else {}),
        }

    def warnings(self) -> list[str]:
        """One line per column left out."""
        lines = [f"column {name!r} is not used as a feature: {why}" for name, why in self.dropped.items()]
        return lines + list(self.notes)


def describe(doc: dict[str, Any]) -> str:
    """``features (3 of 4 columns): a, b, c`` for a :meth:`FeatureUsage.to_json` document."""
    used = list(doc.get("used") or [])
    dropped = dict(doc.get("dropped") or {})
    total = len(used) + len(dropped)
    of = f" of {total} columns" if dropped else ""
    names = ", ".join(used) if used else f"{doc.get('width', 0)} unnamed columns"
    label = f"; label: {doc['label']}" if doc.get("label") else ""
    return f"features ({len(used)}{of}): {names}{label}"


def feature_usage(ref: str, ds: Dataset) -> FeatureUsage:
    """What a model trained on ``ds`` (loaded from ``ref``) uses, and what it leaves out and why."""
    width = int(ds.X.shape[1]) if ds.X.ndim == 2 else 1
    if ref.startswith(("sklearn:", "npz:")):
        return FeatureUsage(used=tuple(ds.feature_names), width=width)
    return _catalog_usage(ref, tuple(ds.feature_names), width)


@functools.lru_cache(maxsize=32)
def _catalog_usage(ref: str, used: tuple[str, ...], width: int) -> FeatureUsage:
    from gpuyard.data.arrays import BOOKKEEPING, resolve_selection

    version, _splits, _recorded = resolve_selection(ref)
    label = version.label_column
    dropped: dict[str, str] = {}
    for col in version.manifest["schema"]:
        name, kind = str(col["name"]), str(col.get("kind"))
        if name in used or name == label or name in BOOKKEEPING:
            continue
        dropped[name] = _why(version, name, kind, str(col.get("type")))
    return FeatureUsage(used=used, dropped=dropped, label=label, width=width)


def _why(version: Any, name: str, kind: str, arrow_type: str) -> str:
    from gpuyard.data.infer import MOSTLY_NUMERIC, guess_column

    if kind != "string":
        return f"its type ({arrow_type}) is not a number, bool or tensor"
    hint = (
        f"encode it in a recipe ('encode: [{{column: {name}}}]'), hash it ('text_hash'), or "
        f"drop it ('drop: [{name}]') to say it is not wanted"
    )
    guess = guess_column(version.to_arrow([name]).column(name))
    if guess.values and guess.share >= MOSTLY_NUMERIC:
        return (
            f"it is text although {guess.share:.1%} of its values are numbers (e.g. "
            f"{', '.join(map(repr, guess.examples))}): declare 'type: float' for it in the ingest "
            f"--checks to make it numeric (its other rows are then quarantined), or {hint}"
        )
    return f"it is text, and a model takes numbers: {hint}"
