"""Drift: served inputs and predictions over a sliding window, against the training data's reference.

Two tests per feature, both standard in model monitoring:

- PSI (population stability index) over the reference's decile bins,
  ``sum((a - e) * ln(a / e))``. The usual reading (Siddiqi, *Credit Risk Scorecards*, 2006):
  below 0.1 stable, 0.1-0.25 some shift, above 0.25 a significant shift; 0.25 is the default alert.
- Kolmogorov-Smirnov two-sample test (``scipy.stats.ks_2samp``) between the window and a reference
  sample; the p-value threshold is divided by the number of features (Bonferroni), so a model with
  64 features does not alert on chance alone.

Predictions drift the same way: class proportions (PSI) for a classifier, values (PSI and KS) for a
regressor, against the model's own predictions on the reference sample.

Skew: a model served with a recipe also takes raw records; their raw columns (before the recipe) are
tested the same way against the rows the model was trained on (:func:`build_skew_reference`): PSI
and KS per numeric column, PSI over the training categories plus an "unseen" bin for a text or
boolean column (KS means nothing there). Its alerts are ``input_skew``, named by the raw column.

The reference (bin edges, expected proportions, a sample of at most ``SAMPLE`` values per feature)
comes from the training dataset recorded in the model version's lineage: the dataset manifests keep
count/mean/std/min/max per column, which is not enough for KS, so the reference is computed once from
the dataset itself and cached in the ``serve_drift_references`` table for every replica and restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuyard.serve.options import DriftConfig

SAMPLE = 500  # reference values kept per feature for KS (JSON in the store; ~4 kB per feature)
MAX_FEATURES = 64  # the first features monitored; wider inputs (images) are summarised by these
MAX_CATEGORIES = 50  # categories of a raw text column kept in a skew reference (the rest: unseen)
BINS = 10
EPS = 1e-4  # floor of a bin's share, so an empty bin does not make PSI infinite


def _edges(values: np.ndarray) -> list[float]:
    qs = np.quantile(values, np.linspace(0, 1, BINS + 1)[1:-1])
    return [float(x) for x in np.unique(qs)]


def _shares(values: np.ndarray, edges: list[float]) -> np.ndarray:
    counts = np.bincount(np.searchsorted(np.asarray(edges), values, side="right"), minlength=len(edges) + 1)
    return counts / max(len(values), 1)


def psi(expected: np.ndarray, actual: np.ndarray) -> float:
    """Population stability index of two share vectors (each summing to 1)."""
    e = np.clip(np.asarray(expected, dtype=np.float64), EPS, None)
    a = np.clip(np.asarray(actual, dtype=np.float64), EPS, None)
    return float(np.sum((a - e) * np.log(a / e)))


def ks(sample: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """KS two-sample statistic and p-value."""
    from scipy.stats import ks_2samp

    res = ks_2samp(sample, values)
    return float(res.statistic), float(res.pvalue)


def build_reference(
    X: np.ndarray, predictions: np.ndarray, task: str, names: list[str], source: str, seed: int = 0
) -> dict[str, Any]:
    """The reference document for inputs ``X`` (training data) and the model's predictions on them."""
    rng = np.random.default_rng(seed)
    flat = np.asarray(X, dtype=np.float64).reshape(len(X), -1)[:, :MAX_FEATURES]
    features = []
    for j in range(flat.shape[1]):
        col = flat[:, j]
        edges = _edges(col)
        sample = np.sort(rng.choice(col, size=min(SAMPLE, len(col)), replace=False))
        features.append(
            {
                "name": names[j],
                "edges": edges,
                "expected": _shares(col, edges).tolist(),
                "sample": sample.tolist(),
            }
        )
    preds = np.asarray(predictions).reshape(len(predictions))
    if task == "classification":
        labels, counts = np.unique(preds, return_counts=True)
        pred_ref = {
            "kind": "classes",
            "labels": labels.tolist(),
            "expected": (counts / counts.sum()).tolist(),
        }
    else:
        vals = preds.astype(np.float64)
        edges = _edges(vals)
        sample = np.sort(rng.choice(vals, size=min(SAMPLE, len(vals)), replace=False))
        pred_ref = {
            "kind": "values",
            "edges": edges,
            "expected": _shares(vals, edges).tolist(),
            "sample": sample.tolist(),
        }
    return {"source": source, "rows": len(flat), "features": features, "predictions": pred_ref}


def build_skew_reference(
    columns: dict[str, tuple[str, np.ndarray]], source: str, seed: int = 0
) -> dict[str, Any]:
    """The skew reference of raw columns: ``column -> (kind, values)`` of the training rows, where kind
    is ``numeric`` (float64 values) or ``categorical`` (text or booleans; None for a null)."""
    rng = np.random.default_rng(seed)
    features: list[dict[str, Any]] = []
    rows = 0
    for name, (kind, values) in columns.items():
        rows = max(rows, len(values))
        if kind == "numeric":
            col = values[np.isfinite(values)]
            if not len(col):
                continue
            edges = _edges(col)
            sample = np.sort(rng.choice(col, size=min(SAMPLE, len(col)), replace=False))
            features.append(
                {
                    "name": name,
                    "edges": edges,
                    "expected": _shares(col, edges).tolist(),
                    "sample": sample.tolist(),
                }
            )
            continue
        labels, counts = _categories([v for v in values.tolist() if v is not None])
        shares = counts / max(counts.sum(), 1)
        features.append(
            {
                "name": name,
                "kind": "categorical",
                "labels": labels,
                "edges": [i + 0.5 for i in range(len(labels))],  # code i -> bin i; unseen (len) -> last
                "expected": [*shares.tolist(), 0.0],
            }
        )
        if len(features) >= MAX_FEATURES:
            break
    return {"source": source, "rows": rows, "features": features, "predictions": None}


def _categories(values: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The most frequent categories (at most ``MAX_CATEGORIES``, the rest count as unseen) and counts."""
    from collections import Counter

    common = Counter(values).most_common(MAX_CATEGORIES)
    return [v for v, _ in common], np.asarray([c for _, c in common], dtype=np.float64)


def skew_rows(reference: dict[str, Any], table: Any) -> np.ndarray:
    """The raw columns of an Arrow ``table`` (records as the recipe reads them) as the skew window's
    rows: numbers as they are (null as NaN), a category as its index among the reference's labels, an
    unseen one (or null) as the number of labels."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = np.empty((table.num_rows, len(reference["features"])), dtype=np.float32)
    for j, f in enumerate(reference["features"]):
        column = table.column(f["name"])
        if f.get("kind") == "categorical":
            labels = f["labels"]
            found = pc.index_in(column, value_set=pa.array(labels, column.type)) if labels else None
            codes = (
                np.full(table.num_rows, len(labels), dtype=np.float64)
                if found is None
                else np.asarray(pc.fill_null(found, len(labels)).to_numpy(zero_copy_only=False), np.float64)
            )
            out[:, j] = codes
        else:
            values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
            out[:, j] = np.asarray(values, dtype=np.float64)
    return out


def compare(
    reference: dict[str, Any], inputs: np.ndarray, predictions: np.ndarray | None, cfg: DriftConfig
) -> dict[str, Any]:
    """Every drift figure of a window against ``reference``; ``drifted`` lists what crossed a threshold.

    A reference without ``predictions`` (skew: raw columns) has no prediction figures (None).
    """
    feats = reference["features"]
    ks_p = cfg.ks_alpha / max(sum(f.get("kind") != "categorical" for f in feats), 1)
    out: list[dict[str, Any]] = []
    for j, f in enumerate(feats):
        col = inputs[:, j].astype(np.float64)
        out.append({"feature": f["name"], **_numeric_drift(f, col, ks_p, cfg)})
    pred = None
    if reference.get("predictions") is not None and predictions is not None:
        pred = _prediction_drift(reference["predictions"], predictions, ks_p, cfg)
    return {
        "rows": len(inputs),
        "ks_pvalue_threshold": ks_p,
        "psi_threshold": cfg.psi_threshold,
        "features": out,
        "predictions": pred,
    }


def _prediction_drift(
    ref: dict[str, Any], preds: np.ndarray, ks_p: float, cfg: DriftConfig
) -> dict[str, Any]:
    if ref["kind"] == "classes":
        # The window stores predictions as float64: match class labels by numeric value.
        index = {float(v): i for i, v in enumerate(ref["labels"])}
        counts = np.zeros(len(index) + 1)  # last bin: labels never seen in training
        for v, c in zip(*np.unique(preds, return_counts=True), strict=True):
            counts[index.get(float(v), len(index))] += c
        p = psi(np.append(ref["expected"], 0.0), counts / max(counts.sum(), 1))
        return {"psi": round(p, 5), "drift_psi": p >= cfg.psi_threshold}
    return _numeric_drift(ref, preds.astype(np.float64), ks_p, cfg)


def _numeric_drift(ref: dict[str, Any], values: np.ndarray, ks_p: float, cfg: DriftConfig) -> dict[str, Any]:
    """PSI over the reference's bins and KS against its sample, for one numeric column (a feature, or a
    regressor's predictions)."""
    values = values[np.isfinite(values)]  # a null raw number: not a value to compare
    p = psi(np.asarray(ref["expected"]), _shares(values, ref["edges"]))
    if ref.get("kind") == "categorical" or not len(values):
        # Categories have no order: PSI over them (and the unseen bin) is the test; KS means nothing.
        return {
            "psi": round(p, 5),
            "ks": None,
            "ks_pvalue": None,
            "drift_psi": p >= cfg.psi_threshold,
            "drift_ks": False,
        }
    stat, pvalue = ks(np.asarray(ref["sample"]), values)
    return {
        "psi": round(p, 5),
        "ks": round(stat, 5),
        "ks_pvalue": pvalue,
        "drift_psi": p >= cfg.psi_threshold,
        "drift_ks": pvalue < ks_p,
    }


class DriftMonitor:
    """A ring buffer of served rows and predictions, evaluated by a background thread.

    Args:
        reference: from :func:`build_reference`.
        config: window and thresholds.
        on_alert: called (in the evaluator thread) with the list of new alerts.
        on_report: called with every report (metrics gauges hang here).
        kind: the alerts' kind for inputs (``input_drift``; ``input_skew`` for raw columns).
    """

    def __init__(
        self,
        reference: dict[str, Any],
        config: DriftConfig,
        on_alert: Callable[[list[dict[str, Any]]], None] | None = None,
        on_report: Callable[[dict[str, Any]], None] | None = None,
        kind: str = "input_drift",
    ) -> None:
        self.reference, self.config, self.kind = reference, config, kind
        self.on_alert, self.on_report = on_alert, on_report
        self.n_features = len(reference["features"])
        self._x = np.zeros((config.window, self.n_features), dtype=np.float32)
        self._p = np.zeros(config.window, dtype=np.float64)
        self._pos = self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_alert: dict[tuple[str, str], float] = {}
        self.last_report: dict[str, Any] | None = None

    def observe(self, inputs: np.ndarray, predictions: np.ndarray | None = None) -> None:
        """Copy a batch into the window (called from the model thread: a copy, no statistics)."""
        x = inputs.reshape(len(inputs), -1)[:, : self.n_features]
        p = np.zeros(len(inputs)) if predictions is None else np.asarray(predictions, dtype=np.float64)
        p = p.reshape(len(inputs))
        w = self.config.window
        if len(x) > w:  # only the newest `window` rows can stay
            x, p = x[-w:], p[-w:]
        with self._lock:
            # At most two slice copies (up to the ring's end, then from its start): cheaper in the
            # model thread than a fancy-indexed write through an index array.
            done = 0
            while done < len(x):
                n = min(len(x) - done, w - self._pos)
                self._x[self._pos : self._pos + n] = x[done : done + n]
                self._p[self._pos : self._pos + n] = p[done : done + n]
                self._pos = (self._pos + n) % w
                done += n
            self._count = min(self._count + len(x), w)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's rows and predictions (copies)."""
        with self._lock:
            return self._x[: self._count].copy(), self._p[: self._count].copy()

    def evaluate(self) -> dict[str, Any] | None:
        """Run the tests on the current window; return the report (None below ``min_rows``)."""
        x, p = self.snapshot()
        if len(x) < self.config.min_rows:
            return None
        report = compare(self.reference, x, p, self.config)
        report["at"] = time.time()
        self.last_report = report
        if self.on_report is not None:
            self.on_report(report)
        alerts = self._new_alerts(report)
        if alerts and self.on_alert is not None:
            self.on_alert(alerts)
        return report

    def _new_alerts(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        now, alerts = time.monotonic(), []
        rows = [(self.kind, f) for f in report["features"]]
        if report["predictions"] is not None:
            rows.append(("prediction_drift", report["predictions"]))
        for kind, fig in rows:
            for metric, threshold in (
                ("psi", report["psi_threshold"]),
                ("ks", report["ks_pvalue_threshold"]),
            ):
                if not fig.get(f"drift_{metric}"):
                    continue
                key = (f"{kind}:{fig.get('feature', '')}", metric)
                if now - self._last_alert.get(key, -np.inf) < self.config.cooldown_s:
                    continue
                self._last_alert[key] = now
                value = fig["psi"] if metric == "psi" else fig["ks_pvalue"]
                alerts.append(
                    {
                        "kind": kind,
                        "feature": fig.get("feature"),
                        "metric": metric,
                        "value": value,
                        "threshold": threshold,
                        "window": report["rows"],
                        "detail": fig,
                    }
                )
        return alerts

    def start(self) -> None:
        """Evaluate every ``interval_s`` seconds in a daemon thread."""
        # Import scipy.stats now, in the caller (before serving): imported lazily by the first
        # evaluation it took ~1.5 s of CPU holding the GIL, stalling every request in flight.
        import scipy.stats  # noqa: F401

        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpuyard-drift", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the evaluator thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.evaluate()
            except Exception:  # a failed evaluation is retried next interval; serving goes on
                continue
