"""Reading tracked runs back: listing, one run in full, side-by-side comparison and metric curves (PNG)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.states import RunStatus
from gpuyard.store import get_store
from gpuyard.store.db import Store
from gpuyard.store.tables.models import EvaluationRow, RunArtifactRow, RunMetricRow, RunRow


@dataclass(frozen=True)
class RunSummary:
    """A run as listed: identity, status, lineage and the last value of each metric."""

    id: str
    name: str
    experiment: str
    kind: str
    status: str
    parent_id: str | None
    params: dict[str, Any]
    tags: dict[str, Any]
    code_version: str | None
    dataset_version: str | None
    started_at: datetime
    ended_at: datetime | None
    error: str | None
    team: str = "default"
    latest: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (timestamps in ISO 8601)."""
        doc = asdict(self)
        doc["started_at"] = self.started_at.isoformat()
        doc["ended_at"] = self.ended_at.isoformat() if self.ended_at else None
        return doc


def _summary(row: RunRow, latest: dict[str, float | None]) -> RunSummary:
    return RunSummary(
        id=row.id,
        name=row.name,
        experiment=row.experiment,
        kind=row.kind,
        status=row.status,
        parent_id=row.parent_id,
        params=dict(row.params),
        tags=dict(row.tags),
        code_version=row.code_version,
        dataset_version=row.dataset_version,
        started_at=row.started_at,
        ended_at=row.ended_at,
        error=row.error,
        team=row.team,
        latest=latest,
    )


def _latest_metrics(s: Any, run_ids: list[str], system: bool = False) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {r: {} for r in run_ids}
    if not run_ids:
        return out
    rows = s.execute(
        select(RunMetricRow.run_id, RunMetricRow.key, RunMetricRow.value)
        .where(RunMetricRow.run_id.in_(run_ids))
        .order_by(RunMetricRow.step, RunMetricRow.id)
    )
    for run_id, key, value in rows:
        if system or not key.startswith("sys/"):
            out[run_id][key] = value  # ordered by step: the last one wins
    return out


def resolve_run_id(ref: str, store: Store | None = None) -> str:
    """The full id of the run whose id is ``ref`` or starts with it (at least 4 characters).

    Raises:
        NotFoundError: no such run. ConfigError: the prefix is too short or ambiguous.
    """
    store = store or get_store()
    if len(ref) < 4:
        raise ConfigError(f"run id {ref!r} is too short: give at least 4 characters")
    with store.read() as s:
        ids = list(s.scalars(select(RunRow.id).where(RunRow.id.startswith(ref)).limit(3)))
    if not ids:
        raise NotFoundError(f"run {ref!r} not found (see `gpuyard runs ls`)")
    if len(ids) > 1:
        raise ConfigError(f"run id prefix {ref!r} matches several runs; give more characters")
    return ids[0]


def list_runs(
    experiment: str | None = None,
    status: str | None = None,
    kind: str | None = None,
    parent_id: str | None = None,
    limit: int = 50,
    store: Store | None = None,
    team: str | None = None,
) -> list[RunSummary]:
    """Runs, newest first, filtered by experiment, status, kind, parent or team."""
    store = store or get_store()
    query = select(RunRow).order_by(RunRow.started_at.desc()).limit(limit)
    if experiment:
        query = query.where(RunRow.experiment == experiment)
    if status:
        query = query.where(RunRow.status == status)
    if kind:
        query = query.where(RunRow.kind == kind)
    if parent_id:
        query = query.where(RunRow.parent_id == parent_id)
    if team:
        query = query.where(RunRow.team == team)
    with store.read() as s:
        rows = list(s.scalars(query))
        latest = _latest_metrics(s, [r.id for r in rows])
    return [_summary(r, latest[r.id]) for r in rows]


def run_teams(store: Store | None = None) -> set[str]:
    """The teams that have runs."""
    store = store or get_store()
    with store.read() as s:
        return set(s.scalars(select(RunRow.team).distinct()))


def get_run(ref: str, store: Store | None = None) -> RunSummary:
    """One run by id or unique id prefix, with the last value of every metric."""
    store = store or get_store()
    run_id = resolve_run_id(ref, store)
    with store.read() as s:
        row = s.get(RunRow, run_id)
        if row is None:  # deleted between the two reads
            raise NotFoundError(f"run {ref!r} not found (see `gpuyard runs ls`)")
        return _summary(row, _latest_metrics(s, [run_id])[run_id])


def run_details(ref: str, store: Store | None = None) -> dict[str, Any]:
    """Everything about a run: summary, system info, artifacts, evaluations, child runs, series lengths."""
    store = store or get_store()
    run = get_run(ref, store)
    with store.read() as s:
        row = s.get(RunRow, run.id)
        artifacts = [
            {"name": a.name, "key": a.key, "sha256": a.sha256, "size": a.size}
            for a in s.scalars(select(RunArtifactRow).where(RunArtifactRow.run_id == run.id))
        ]
        evaluations = [
            {"split": e.split, "task": e.task, "dataset_version": e.dataset_version, "n": e.n_samples}
            | {"metrics": e.metrics, "details": e.details}
            for e in s.scalars(select(EvaluationRow).where(EvaluationRow.run_id == run.id))
        ]
        children = list(s.scalars(select(RunRow.id).where(RunRow.parent_id == run.id)))
        system = dict(row.system) if row else {}
    series = metric_series(run.id, store=store)
    doc = run.to_json()
    doc |= {"system": system, "artifacts": artifacts, "evaluations": evaluations, "children": children}
    doc["series"] = {k: len(v) for k, v in series.items()}
    # The last sample of each system metric (CPU, memory, RSS, GPU memory), next to the run's machine.
    doc["system_metrics"] = {k: v[-1][1] for k, v in series.items() if k.startswith("sys/") and v}
    return doc


def metric_series(
    run_id: str, keys: list[str] | None = None, store: Store | None = None
) -> dict[str, list[tuple[int, float | None]]]:
    """``{key: [(step, value), ...]}`` of a run, ordered by step (all keys when ``keys`` is None)."""
    store = store or get_store()
    query = select(RunMetricRow.key, RunMetricRow.step, RunMetricRow.value).where(
        RunMetricRow.run_id == run_id
    )
    if keys:
        query = query.where(RunMetricRow.key.in_(keys))
    out: dict[str, list[tuple[int, float | None]]] = {}
    with store.read() as s:
        for key, step, value in s.execute(query.order_by(RunMetricRow.step, RunMetricRow.id)):
            out.setdefault(key, []).append((step, value))
    return out


def compare_runs(refs: list[str], store: Store | None = None) -> dict[str, Any]:
    """Params and latest metrics of several runs, keyed by name, with the keys that differ marked.

    Returns:
        ``{"runs": [ids], "params": {key: [value per run]}, "metrics": {key: [...]}, "differs": [keys]}``.
    """
    if len(refs) < 2:
        raise ConfigError("compare needs at least two runs")
    store = store or get_store()
    runs = [get_run(r, store) for r in refs]
    params = sorted({k for r in runs for k in r.params})
    metrics = sorted({k for r in runs for k in r.latest})
    table_p = {k: [r.params.get(k) for r in runs] for k in params}
    table_m = {k: [r.latest.get(k) for r in runs] for k in metrics}
    differs = [k for k, vals in table_p.items() if len({repr(v) for v in vals}) > 1]
    return {
        "runs": [r.id for r in runs],
        "names": [r.name for r in runs],
        "dataset_versions": [r.dataset_version for r in runs],
        "params": table_p,
        "metrics": table_m,
        "differs": differs,
    }


def plot_curves(
    run_refs: list[str], out: str | Path, keys: list[str] | None = None, store: Store | None = None
) -> Path:
    """Draw each metric series of the runs (one panel per metric, one line per run) into a PNG.

    Raises:
        NotFoundError: none of the runs has a metric among ``keys``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display here, and the CLI must never open a window
    import matplotlib.pyplot as plt

    store = store or get_store()
    runs = [get_run(r, store) for r in run_refs]
    data = {r.id: metric_series(r.id, keys, store) for r in runs}
    names = sorted({k for d in data.values() for k in d if keys or not k.startswith("sys/")})
    if not names:
        wanted = ", ".join(keys) if keys else "any metric"
        raise NotFoundError(f"runs {', '.join(r.id[:8] for r in runs)} have no series for {wanted}")
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, names, strict=False):
        for run in runs:
            points = [(st, v) for st, v in data[run.id].get(key, []) if v is not None]
            if points:
                ax.plot(
                    *zip(*points, strict=True), marker="." if len(points) < 30 else None, label=run.id[:8]
                )
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def best_run(
    metric: str,
    direction: str | None = None,
    *,
    split: str = "validation",
    experiment: str | None = None,
    parent_id: str | None = None,
    kind: str | None = None,
    store: Store | None = None,
) -> tuple[RunSummary, float]:
    """The finished run with the best ``<split>/<metric>`` among those selected.

    Args:
        metric: a metric name (``accuracy``, ``mse``...) or any logged key (``cv/accuracy_mean``).
        direction: maximize or minimize (default: the metric's own; required for a free-form key).
        split: the prefix the metric was logged under (validation by default: never select on test).
        experiment, parent_id, kind: which runs to consider.

    Raises:
        ConfigError: unknown metric or direction. NotFoundError: no finished run has that metric.
    """
    from gpuyard.models.metrics import METRICS, check_direction

    if metric in METRICS:
        direction = check_direction(direction or METRICS[metric].direction, metric)
        key = f"{split}/{metric}"
    elif "/" in metric:
        if direction is None:
            raise ConfigError(
                f"metric key {metric!r} is not a known metric: give --direction maximize|minimize"
            )
        direction = check_direction(direction)
        key = metric
    else:
        raise ConfigError(
            f"unknown metric {metric!r}: use one of {', '.join(sorted(METRICS))} or a logged key"
        )
    runs = list_runs(
        experiment=experiment,
        status=RunStatus.FINISHED,
        kind=kind,
        parent_id=parent_id,
        limit=10_000,
        store=store,
    )
    if kind is None:  # folds store no model: they are evidence for a cv run, not candidates
        runs = [r for r in runs if r.kind != "fold"]
    # Oldest first, so a tie goes to the earliest run, as Optuna's best_trial does.
    scored = [(r, r.latest[key]) for r in reversed(runs) if r.latest.get(key) is not None]
    if not scored:
        raise NotFoundError(
            f"no finished run has {key!r}" + (f" in experiment {experiment!r}" if experiment else "")
        )
    pick = max if direction == "maximize" else min
    run, value = pick(scored, key=lambda rv: rv[1])  # type: ignore[arg-type,return-value]
    return run, float(value)  # type: ignore[arg-type]
