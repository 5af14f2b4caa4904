"""Drift references and alerts in the state store, and the hook from an alert to the retraining policy."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import select

from gpuyard.errors import GpuyardError
from gpuyard.models.retrain import on_drift_alert
from gpuyard.serve.drift import build_reference, build_skew_reference
from gpuyard.serve.model import ServedModel
from gpuyard.store import get_store
from gpuyard.store.tables.serve import DeploymentRow, DriftAlertRow, DriftReferenceRow

log = logging.getLogger("gpuyard.serve")
REFERENCE_ROWS = 2000  # training rows sampled to build a reference


def save_reference(name: str, version: int, reference: dict[str, Any]) -> None:
    """Store (or replace) the drift reference of ``name:version``."""
    with get_store().session() as s:
        row = s.get(DriftReferenceRow, (name, version))
        if row is None:
            s.add(
                DriftReferenceRow(
                    model_name=name, model_version=version, source=reference["source"], reference=reference
                )
            )
        else:
            row.source, row.reference = reference["source"], reference


def load_reference(name: str, version: int) -> dict[str, Any] | None:
    """The stored drift reference of ``name:version``, or None."""
    with get_store().read() as s:
        row = s.get(DriftReferenceRow, (name, version))
        return dict(row.reference) if row is not None else None


def reference_from_array(model: ServedModel, X: np.ndarray, source: str = "array") -> dict[str, Any]:
    """Build and store the reference of ``model`` from training inputs ``X`` (library use, tests)."""
    X = np.asarray(X, dtype=np.float32).reshape(len(X), *model.spec.shape)
    if len(X) > REFERENCE_ROWS:
        X = X[np.random.default_rng(0).choice(len(X), REFERENCE_ROWS, replace=False)]
    preds = model.forward(X)["predictions"]
    ref = build_reference(X, preds, model.task, model.spec.feature_names(), source)
    save_reference(model.name, model.version, ref)
    return ref


def reference_for(model: ServedModel) -> tuple[dict[str, Any] | None, str]:
    """The reference for ``model``: stored, else built from the training dataset in its lineage.

    Returns:
        (reference or None, a one-line reason saying where it came from or why there is none).
    """
    ref = load_reference(model.name, model.version)
    if ref is not None:
        names = model.spec.feature_names()
        if len(names) >= len(ref["features"]):
            # A reference stored while the signature had no names (f0, f1...): the columns' names now.
            for feature, name in zip(ref["features"], names, strict=False):
                feature["name"] = name
        if model.spec.recipe is not None and "skew" not in ref:  # stored before skew was checked
            ref = {**ref, "skew": skew_reference(model)}
            save_reference(model.name, model.version, ref)
        return ref, f"stored reference ({ref['source']})"
    record = model.record
    lineage = getattr(record, "lineage", {}) or {}
    dataset = lineage.get("dataset_ref") or getattr(record, "dataset_version", None)
    if not dataset:
        return None, "no training dataset in the model's lineage; set one with reference_from_array()"
    from gpuyard.models.datasets import load_dataset

    try:
        ds = load_dataset(str(dataset))
        ref = reference_from_array(model, ds.X, source=f"dataset:{dataset}")
    except (GpuyardError, ValueError, OSError) as exc:
        return None, f"training dataset {dataset!r} could not be loaded: {exc}"
    if model.spec.recipe is not None:
        ref["skew"] = skew_reference(model)
        save_reference(model.name, model.version, ref)
    return ref, f"built from {dataset}"


def skew_reference(model: ServedModel) -> dict[str, Any] | None:
    """The skew reference of a model served with a recipe: its raw columns over the training rows.

    None when the rows cannot be read any more (the datasets left the catalog): skew is then off and
    drift of the features still runs.
    """
    recipe = model.spec.recipe
    if recipe is None:
        return None
    try:
        columns = recipe.training_columns(REFERENCE_ROWS)
    except (GpuyardError, ValueError, OSError) as exc:
        log.warning("skew reference of %s:%s not built: %s", model.name, model.version, exc)
        return None
    if not columns:
        return None
    return build_skew_reference(columns, source=f"dataset:{recipe.contract['source']}")


def record_alerts(model: ServedModel, alerts: list[dict[str, Any]], deployment_id: int | None) -> list[int]:
    """Write ``alerts`` (from :class:`~gpuyard.serve.drift.DriftMonitor`) and run the retraining hook."""
    ids: list[int] = []
    with get_store().session() as s:
        for a in alerts:
            row = DriftAlertRow(
                deployment_id=deployment_id,
                model_name=model.name,
                model_version=model.version,
                kind=a["kind"],
                feature=a["feature"],
                metric=a["metric"],
                value=float(a["value"]),
                threshold=float(a["threshold"]),
                window_rows=int(a["window"]),
                detail=_jsonable(a["detail"]),
            )
            s.add(row)
            s.flush()
            ids.append(row.id)
    outcome = run_retrain_hook(model, alerts)
    with get_store().session() as s:
        for row in s.scalars(select(DriftAlertRow).where(DriftAlertRow.id.in_(ids))):
            row.retrain = outcome
    return ids


def run_retrain_hook(
    model: ServedModel, alerts: list[dict[str, Any]], hook: Callable[..., Any] = on_drift_alert
) -> dict[str, Any]:
    """Call the retraining policy (model management's :func:`on_drift_alert`) with the alerts.

    Returns:
        ``{"hook": "module:function", "result": ...}``, or ``{"hook": ..., "error": ...}`` when it failed.
    """
    name = f"{hook.__module__}:{hook.__qualname__}"
    try:
        result = hook(model_name=model.name, version=model.version, alerts=_jsonable(alerts))
        return {"hook": name, "result": _jsonable(result)}
    except Exception as exc:  # the policy's failure is recorded with the alert, never fatal to serving
        log.warning("retraining hook %s failed: %s", name, exc)
        return {"hook": name, "error": str(exc)[:500]}


def list_alerts(
    model_name: str | None = None, limit: int = 100, team: str | None = None
) -> list[dict[str, Any]]:
    """Newest alerts first, optionally of one model.

    Args:
        team: only the alerts of this team's deployments (None: every alert, those of no deployment too).
    """
    q = select(DriftAlertRow).order_by(DriftAlertRow.id.desc()).limit(limit)
    if model_name:
        q = q.where(DriftAlertRow.model_name == model_name)
    if team is not None:
        q = q.join(DeploymentRow, DeploymentRow.id == DriftAlertRow.deployment_id).where(
            DeploymentRow.team == team
        )
    with get_store().read() as s:
        return [
            {
                "id": r.id,
                "deployment_id": r.deployment_id,
                "model": r.model_name,
                "version": r.model_version,
                "kind": r.kind,
                "feature": r.feature,
                "metric": r.metric,
                "value": r.value,
                "threshold": r.threshold,
                "window": r.window_rows,
                "retrain": r.retrain,
                "created_at": r.created_at.isoformat(),
            }
            for r in s.scalars(q)
        ]


def _jsonable(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {str(k): _jsonable(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_jsonable(v) for v in doc]
    if isinstance(doc, np.generic):
        return doc.item()
    if isinstance(doc, float) and not np.isfinite(doc):
        return None
    return doc
