"""Request and response bodies: JSON and safetensors tensors, checked against the model's signature.

Two request formats reach the same checks:

- ``application/json``: ``{"inputs": [[...], ...]}`` (a batch) or ``{"inputs": [...]}`` (one sample) of
  the model's numeric features; or raw records, ``{"records": [{"column": value, ...}, ...]}`` (a
  batch) or ``{"records": {...}}`` (one record; objects under ``"inputs"`` are read the same way),
  which the model's serving recipe (:class:`gpuyard.models.signature.ServingRecipe`, the training
  dataset's fitted transform) turns into features. A model without a recipe takes records keyed by
  its feature names when its signature names every feature.
- ``application/x-safetensors``: a safetensors file holding a tensor named ``inputs``. It is compact
  (raw little-endian numbers after a small JSON header), readable from any language that has a
  safetensors library, and its parser (Rust) never executes code from the body.

Every way a body can be wrong ends in :class:`BadInput` (HTTP 400 for an unreadable body, 422 for one
that does not match the signature); nothing here lets a body reach the model unchecked.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.models.signature import ServingRecipe

JSON_MEDIA = "application/json"
TENSOR_MEDIA = "application/x-safetensors"
INPUT_KEY = "inputs"
RECORDS_KEY = "records"
RecordsHook = Callable[[Any], None]  # called with the raw records' Arrow table
# Values farther than this many training ranges outside the observed [min, max] are refused as
# garbage (1e30, a unit error); milder shifts are accepted and show up in drift monitoring instead.
RANGE_SLACK = 1.0


class BadInput(GpuyardError):
    """A request body the server cannot read (400)."""

    http_status = 400


class InputMismatch(ConfigError):
    """A readable body that does not match the model's signature (422)."""


@dataclass(frozen=True)
class InputSpec:
    """The input part of a signature, prepared for fast checks.

    Attributes:
        shape: per-sample shape (the signature's shape without its batch dimension).
        low: smallest accepted value per flattened feature (``-inf`` when the signature has no range).
        high: largest accepted value per flattened feature.
        names: feature names, when the signature has them.
        max_rows: most samples one request may carry.
        recipe: the serving recipe that turns raw records into features (None: the signature has none).
    """

    shape: tuple[int, ...]
    low: np.ndarray
    high: np.ndarray
    names: tuple[str, ...]
    max_rows: int
    recipe: ServingRecipe | None = None

    @property
    def n_features(self) -> int:
        """Values per sample."""
        return int(np.prod(self.shape)) if self.shape else 1

    def feature_names(self) -> list[str]:
        """Names of the flattened features (``f0``, ``f1``... when the signature has none)."""
        if len(self.names) == self.n_features:
            return list(self.names)
        return [f"f{i}" for i in range(self.n_features)]


def input_spec(signature: dict[str, Any], max_rows: int = 1024) -> InputSpec:
    """Build the checks for ``signature`` (as the registry stores it: ``inputs.shape/min/max/names``).

    Raises:
        ConfigError: the signature has no input shape, or a shape with free dimensions past the batch.
    """
    inputs = signature.get("inputs") or {}
    shape = inputs.get("shape")
    if not shape or not isinstance(shape, list):
        raise ConfigError("the model's signature has no inputs.shape: it cannot be served safely")
    sample = tuple(int(d) for d in shape[1:])
    if any(d < 1 for d in sample):
        raise ConfigError(f"signature inputs.shape {shape}: only the batch dimension may be -1")
    n = int(np.prod(sample)) if sample else 1
    low = np.full(n, -np.inf, dtype=np.float32)
    high = np.full(n, np.inf, dtype=np.float32)
    lo, hi = inputs.get("min"), inputs.get("max")
    if isinstance(lo, list) and isinstance(hi, list) and len(lo) == n and len(hi) == n:
        lo_a, hi_a = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        # Widen by the larger of the span and the magnitude (at least 1): a constant feature has no span,
        # and a narrow one far from 0 (100..101) would otherwise refuse a 2% shift.
        span = np.maximum.reduce([hi_a - lo_a, np.abs(lo_a), np.abs(hi_a), np.ones(n)])
        low = (lo_a - RANGE_SLACK * span).astype(np.float32)
        high = (hi_a + RANGE_SLACK * span).astype(np.float32)
    names = tuple(str(x) for x in inputs.get("names") or ())
    recipe = ServingRecipe.from_signature(signature)
    return InputSpec(shape=sample, low=low, high=high, names=names, max_rows=max_rows, recipe=recipe)


def decode_json(body: bytes, spec: InputSpec, on_records: RecordsHook | None = None) -> np.ndarray:
    """Parse a JSON body into a float32 batch and check it.

    ``on_records`` is called with the raw records' Arrow table once a request of raw records has
    passed every check (the skew window hangs here); its exceptions are swallowed.

    Raises:
        BadInput: not JSON, or no ``inputs`` list. InputMismatch: see :func:`check_batch`.
    """
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadInput(f"body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or (INPUT_KEY in doc) == (RECORDS_KEY in doc):
        raise BadInput(
            'body must be a JSON object with either an "inputs" field (a list of samples) or a "records"'
            " field (objects keyed by column)"
        )
    if RECORDS_KEY in doc:
        return decode_records(doc[RECORDS_KEY], spec, on_records)
    values = doc[INPUT_KEY]
    if isinstance(values, dict) or (isinstance(values, list) and values and isinstance(values[0], dict)):
        return decode_records(values, spec, on_records)
    if not isinstance(values, list) or not values:
        raise InputMismatch('"inputs" must be a non-empty list of numbers or of samples')
    try:
        raw = np.asarray(values)
    except (ValueError, RecursionError):
        raise InputMismatch('"inputs" is ragged: every sample must have the same shape') from None
    if raw.dtype.kind not in "iuf":  # strings, null, all-boolean lists and huge ints all land here
        raise InputMismatch(f'"inputs" must hold only numbers (got {_kind_name(raw.dtype)})')
    if (b"true" in body or b"false" in body) and _has_bool(values):
        # NumPy reads [1.5, true] as [1.5, 1.0]: a boolean among numbers is refused, as on its own.
        raise InputMismatch('"inputs" must hold only numbers (got booleans): send 1 or 0, not true or false')
    with np.errstate(over="ignore", invalid="ignore"):
        batch = raw.astype(np.float32)
    return check_batch(batch, spec)


def decode_records(values: Any, spec: InputSpec, on_records: RecordsHook | None = None) -> np.ndarray:
    """Raw records (one object keyed by column, or a list of them) -> the model's checked features.

    With a serving recipe, the recipe's columns are checked and transformed as the training data was;
    without one, the keys must be the signature's feature names and the values numbers.

    Raises:
        InputMismatch: not objects, too many, or a record the recipe refuses (the message names the
        record and the column); then :func:`check_batch`'s checks on the features.
    """
    records = [values] if isinstance(values, dict) else values
    if not isinstance(records, list) or not records:
        raise InputMismatch('"records" must be an object keyed by column or a non-empty list of them')
    if len(records) > spec.max_rows:
        raise InputMismatch(f"a request carries 1 to {spec.max_rows} samples, got {len(records)}")
    table = None
    if spec.recipe is not None:
        try:
            table = spec.recipe.table(records)
            batch = spec.recipe.transform(table)
        except GpuyardError as exc:
            raise InputMismatch(str(exc)) from None
        except Exception as exc:  # what the checks let through and the transform still refused
            raise InputMismatch(f"the records could not be transformed: {str(exc)[:200]}") from None
    else:
        batch = _named_records(records, spec)
    checked = check_batch(batch.reshape(len(records), *spec.shape), spec)
    if table is not None and on_records is not None:
        with contextlib.suppress(Exception):  # monitoring never fails a request
            on_records(table)
    return checked


def _named_records(records: list[Any], spec: InputSpec) -> np.ndarray:
    """Records keyed by the signature's feature names, for a model without a serving recipe."""
    if len(spec.names) != spec.n_features or len(spec.shape) != 1:
        raise InputMismatch(
            "this model takes no raw records: it has no serving recipe and its signature does not name"
            ' its features; send "inputs" (numbers)'
        )
    known = set(spec.names)
    out = np.empty((len(records), spec.n_features), dtype=np.float32)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise InputMismatch(f"record {i} is not an object keyed by column")
        unknown = [k for k in rec if k not in known]
        if unknown:
            raise InputMismatch(
                f"record {i}: unknown column {unknown[0]!r} (the model reads {', '.join(spec.names)})"
            )
        for j, name in enumerate(spec.names):
            if name not in rec:
                raise InputMismatch(f"record {i}: column {name!r} is missing")
            value = rec[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputMismatch(
                    f"record {i}, column {name!r}: a number is expected (booleans, strings, null refused)"
                )
            with np.errstate(over="ignore"):
                out[i, j] = np.float32(value) if abs(value) < 1e39 else np.inf
    return out


def _has_bool(values: Any) -> bool:
    """Whether nested lists ``values`` hold a boolean anywhere (called only when the body says true/false)."""
    stack = [values]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            return True
        if isinstance(item, list):
            stack.extend(item)
    return False


def decode_tensor(body: bytes, spec: InputSpec) -> np.ndarray:
    """Parse a safetensors body (a tensor named ``inputs``) into a float32 batch and check it.

    Raises:
        BadInput: not a safetensors file, or no ``inputs`` tensor. InputMismatch: see :func:`check_batch`.
    """
    from safetensors.numpy import load

    try:
        tensors = load(body)
    except Exception as exc:  # the Rust parser raises SafetensorError, but also ValueError/TypeError
        raise BadInput(f"body is not a safetensors file: {str(exc)[:200]}") from None
    if INPUT_KEY not in tensors:
        raise BadInput(f"safetensors body has no tensor named {INPUT_KEY!r} (found {sorted(tensors)[:5]})")
    raw = tensors[INPUT_KEY]
    if raw.dtype.kind not in "iuf":
        raise InputMismatch(f"tensor 'inputs' has dtype {raw.dtype}: send float or integer numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        batch = raw.astype(np.float32)
    return check_batch(batch, spec)


def check_batch(batch: np.ndarray, spec: InputSpec) -> np.ndarray:
    """Check shape, row count, finiteness and ranges; add the batch axis to a lone sample.

    Raises:
        InputMismatch: the message names the expected shape, the bad sample and the bad feature.
    """
    if batch.shape == spec.shape:
        batch = batch.reshape(1, *spec.shape)
    if batch.ndim != len(spec.shape) + 1 or batch.shape[1:] != spec.shape:
        raise InputMismatch(
            f"input shape {list(batch.shape)} does not match the model's signature {[-1, *spec.shape]}"
        )
    rows = batch.shape[0]
    if rows < 1 or rows > spec.max_rows:
        raise InputMismatch(f"a request carries 1 to {spec.max_rows} samples, got {rows}")
    flat = batch.reshape(rows, -1)
    finite = np.isfinite(flat)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        raise InputMismatch(f"sample {r}, feature {_name(spec, c)}: value is NaN or infinite")
    bad = (flat < spec.low) | (flat > spec.high)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise InputMismatch(
            f"sample {r}, feature {_name(spec, c)}: value {float(flat[r, c]):.6g} is outside the accepted "
            f"range [{float(spec.low[c]):.6g}, {float(spec.high[c]):.6g}] (the training range "
            f"widened on each side by {RANGE_SLACK:g}x max(span, |min|, |max|, 1))"
        )
    return np.ascontiguousarray(batch)


def encode_json(outputs: dict[str, np.ndarray], model: str, version: int) -> bytes:
    """The JSON answer: model, version, and each output as a list."""
    doc: dict[str, Any] = {"model": model, "version": version}
    for key, value in outputs.items():
        doc[key] = value.tolist()
    return json.dumps(doc, separators=(",", ":")).encode()


def encode_tensor(outputs: dict[str, np.ndarray]) -> bytes:
    """The safetensors answer: one tensor per output (``predictions``, ``probabilities``)."""
    from safetensors.numpy import save

    return bytes(save({k: np.ascontiguousarray(v) for k, v in outputs.items()}))


def _name(spec: InputSpec, index: int) -> str:
    names = spec.feature_names()
    return f"{index} ({names[index]})" if len(spec.names) == spec.n_features else str(index)


def _kind_name(dtype: np.dtype) -> str:
    return {
        "U": "strings",
        "S": "bytes",
        "O": "nulls, objects or out-of-range integers",
        "b": "booleans",
    }.get(dtype.kind, str(dtype))
