"""Promotion to production: only when the challenger beats the current production model on the holdout.

Both models are evaluated now, on the same rows (the held-out test split of the challenger's
dataset, or a holdout given explicitly), with the same scikit-learn metric; both evaluations are
recorded against their versions, and the decision (granted or refused) is recorded as a model event.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.models.datasets import SplitSpec, load_dataset, split_dataset
from gpuyard.models.evaluate import evaluate, record_evaluation
from gpuyard.models.metrics import DEFAULT_METRICS, check_direction, get_metric, is_better
from gpuyard.models.registry import ModelVersion, _resolve_row, get_version, load, record_event
from gpuyard.models.signature import check_input
from gpuyard.refs import ModelRef
from gpuyard.states import ModelStage
from gpuyard.store import get_store
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.models import ModelVersionRow


@dataclass(frozen=True)
class PromotionDecision:
    """What promotion decided and on which evidence."""

    name: str
    challenger: int
    production: int | None
    promoted: bool
    metric: str
    direction: str
    challenger_score: float
    production_score: float | None
    holdout: str
    n_samples: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def holdout_for(mv: ModelVersion, holdout: str | None = None) -> tuple[Any, Any, str]:
    """(X, y, description) of the holdout: ``holdout`` (a dataset reference, used whole) or the
    test split of the dataset the version was trained on (as recorded in its lineage): the ``test``
    rows of its split of record when the version has one, else the spec's cut, redone.

    Raises:
        ConfigError: no holdout given and the version's lineage names no dataset.
    """
    if holdout:
        ds = load_dataset(holdout)
        return ds.X, ds.y, ds.version
    ref = mv.lineage.get("dataset_ref")
    if not ref:
        raise ConfigError(f"{mv.ref} records no training dataset: pass --holdout DATASET to promote it")
    split = mv.lineage.get("split") or {}
    ds = load_dataset(ref)
    if ds.has_split_of_record or split.get("of_record"):
        return _test_of_record(mv, ref)
    spec = SplitSpec(
        val=split.get("val", 0.2),
        test=split.get("test", 0.2),
        seed=split.get("seed", 0),
        stratify=split.get("stratify", True),
    )
    parts = split_dataset(ds, spec)
    return parts.X_test, parts.y_test, f"{ds.version} test split (seed {spec.seed}, {spec.test:.0%})"


def _test_of_record(mv: ModelVersion, ref: str) -> tuple[Any, Any, str]:
    """The ``test`` rows of the split of record of the version ``ref`` names (whatever it selected)."""
    from gpuyard.data.arrays import load_arrays, with_splits

    try:
        data = load_arrays(with_splits(ref, ["test"]))
    except ConfigError as exc:
        raise ConfigError(
            f"{mv.ref} was trained on {ref}, whose split of record has no test rows to compare on:"
            " pass --holdout DATASET"
        ) from exc
    return data.X, data.y, f"{data.version} (the test split of record)"


def promote(
    ref: str,
    *,
    metric: str | None = None,
    direction: str | None = None,
    holdout: str | None = None,
    store: Store | None = None,
) -> PromotionDecision:
    """Promote version ``ref`` to production if it beats the current production version on the holdout.

    Args:
        ref: the challenger (``NAME:V``, ``NAME@ALIAS``).
        metric: the deciding metric (default: the one its run optimised, else accuracy / mse).
        direction: maximize or minimize (default: the metric's own).
        holdout: a dataset reference to evaluate on instead of the recorded test split.
        store: the state store.

    Returns:
        The decision; when promoted, the old production version is archived.

    Raises:
        NotFoundError: no such version. ConfigError: unknown metric or direction, a metric of the
        wrong task, or a holdout whose shape does not fit the models.
    """
    store = store or get_store()
    challenger = get_version(ref, store)
    task = challenger.task
    metric = metric or challenger.lineage.get("metric") or DEFAULT_METRICS[task][0]
    get_metric(metric, task)
    direction = check_direction(direction or get_metric(metric).direction, metric)
    current = _current_production(challenger.name, store)
    X, y, desc = holdout_for(challenger, holdout)
    check_input(challenger.signature, X)
    c_score = _score(challenger, X, y, metric, desc, store)
    p_score = None
    if current is not None and current.version != challenger.version:
        p_score = _score(current, X, y, metric, desc, store)
    if current is None:
        promoted, reason = True, "no version is in production yet"
    elif current.version == challenger.version:
        promoted, reason = False, f"{challenger.ref} is already in production"
    elif p_score is not None and is_better(c_score, p_score, direction):
        promoted, reason = True, f"{metric} {c_score:.4f} beats production v{current.version} {p_score:.4f}"
    else:
        promoted, reason = (
            False,
            f"{metric} {c_score:.4f} does not beat production v{current.version} {p_score:.4f}",
        )
    decision = PromotionDecision(
        name=challenger.name,
        challenger=challenger.version,
        production=current.version if current else None,
        promoted=promoted,
        metric=metric,
        direction=direction,
        challenger_score=c_score,
        production_score=p_score,
        holdout=desc,
        n_samples=len(y),
        reason=reason,
    )
    _apply(decision, store)
    return decision


def _current_production(name: str, store: Store) -> ModelVersion | None:
    from gpuyard.errors import NotFoundError

    try:
        return get_version(f"{name}@production", store)
    except NotFoundError:
        return None


def _score(mv: ModelVersion, X: Any, y: Any, metric: str, desc: str, store: Store) -> float:
    loaded = load(mv.ref, store)
    ev = evaluate(loaded.predictor, X, y, mv.task, "holdout", metrics=[metric])
    if metric not in ev.metrics:
        raise ConfigError(f"{mv.ref} cannot be scored on {metric!r} (it gives no class probabilities)")
    record_evaluation(ev, model_name=mv.name, model_version=mv.version, dataset_version=desc, store=store)
    return ev.metrics[metric]


def _apply(decision: PromotionDecision, store: Store) -> None:
    with store.session() as s:
        if decision.promoted:
            for row in s.query(ModelVersionRow).filter_by(name=decision.name, stage=ModelStage.PRODUCTION):
                row.stage = ModelStage.ARCHIVED
                record_event(
                    s,
                    row.name,
                    row.version,
                    "stage",
                    {"from": ModelStage.PRODUCTION, "to": ModelStage.ARCHIVED},
                )
            row = _resolve_row(s, str(ModelRef(decision.name, decision.challenger)))
            row.stage, row.updated_at = ModelStage.PRODUCTION, utcnow()
        action = "promoted" if decision.promoted else "promotion_refused"
        record_event(s, decision.name, decision.challenger, action, decision.to_json())
