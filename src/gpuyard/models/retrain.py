"""Continuous learning: a retraining policy decides, a runner trains, evaluates, registers and promotes.

:func:`decide` is a pure function of the policy and a :class:`PolicyState` snapshot (which dataset
version production was trained on, the newest version, open drift alerts, the last retrain, the
time), returning a :class:`RetrainDecision`. :func:`run_policy` gathers the snapshot from the
registry, the dataset catalog and recorded drift alerts, then carries a positive decision out:
train (with production's params) -> evaluate (validation and test apart) -> register the challenger
(stage staging) -> promote only when it beats production on the holdout.

Serving calls :func:`on_drift_alert` when a drift alert fires; it records the alert as a model event
(fast: no training inside the server), and the next :func:`run_policy` pass acts on it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.refs import DatasetRef
from gpuyard.states import ModelStage
from gpuyard.store.base import utcnow
from gpuyard.textfiles import load_yaml

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``30``, ``90s``, ``15m``, ``12h``, ``7d`` or ``2w``.

    Raises:
        ConfigError: anything else, or a non-positive duration.
    """
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise ConfigError(f"duration {text!r}: use a number with s, m, h, d or w (e.g. 12h)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ConfigError(f"duration {text!r} must be positive")
    return seconds


class Triggers(BaseModel):
    """What may start a retrain."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    new_dataset_version: bool = True
    drift: bool = True
    every: str | None = None  # e.g. 7d: retrain at least this often

    @field_validator("every")
    @classmethod
    def _every(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_duration(v)
            except ConfigError as exc:
                raise ValueError(str(exc)) from exc
        return v


class RetrainPolicy(BaseModel):
    """A retraining policy (YAML). ``spec`` is the model spec used to train, relative to the policy file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)
    spec: str = Field(min_length=1)
    dataset: str | None = None  # what to watch and train on (default: the spec's dataset)
    triggers: Triggers = Field(default_factory=lambda: Triggers())
    cooldown: str = "1h"  # no drift-triggered retrain sooner than this after the last one
    metric: str | None = None  # promotion metric (default: the spec's)
    params_from: Literal["production", "spec"] = "production"

    @field_validator("cooldown")
    @classmethod
    def _cooldown(cls, v: str) -> str:
        try:
            parse_duration(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        return v


@dataclass(frozen=True)
class PolicyState:
    """What the policy looks at, gathered at one moment."""

    now: datetime
    production_version: int | None
    production_dataset_version: str | None
    production_since: datetime | None
    latest_dataset_version: str | None
    last_retrain_at: datetime | None
    # The dataset version the last retrain used: a refused challenger is not retrained on it again.
    last_retrain_dataset_version: str | None = None
    drift_alerts: list[dict[str, Any]] = field(default_factory=list)  # each with "at" (datetime)


@dataclass(frozen=True)
class RetrainDecision:
    """Whether to retrain, why (every reason that held), and on which dataset version."""

    retrain: bool
    reasons: list[str]
    dataset_version: str | None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def decide(policy: RetrainPolicy, state: PolicyState) -> RetrainDecision:
    """The retraining decision for ``state`` under ``policy`` (pure: no I/O, no clock)."""
    reasons: list[str] = []
    target = state.latest_dataset_version
    if state.production_version is None:
        return RetrainDecision(True, ["no version of the model is in production"], target)
    t = policy.triggers
    seen = (state.production_dataset_version, state.last_retrain_dataset_version)
    if t.new_dataset_version and target and target not in seen:
        reasons.append(
            f"new dataset version {target} (production trained on {state.production_dataset_version})"
        )
    if t.drift:
        since = state.last_retrain_at or state.production_since
        fresh = [a for a in state.drift_alerts if since is None or a["at"] > since]
        cooldown = timedelta(seconds=parse_duration(policy.cooldown))
        if fresh and state.last_retrain_at is not None and state.now - state.last_retrain_at < cooldown:
            pass  # drift during the cooldown: wait, the last retrain may not have been deployed yet
        elif fresh:
            reasons.append(f"{len(fresh)} drift alert(s) since {since.isoformat() if since else 'the start'}")
    if t.every:
        last = state.last_retrain_at or state.production_since
        period = timedelta(seconds=parse_duration(t.every))
        if last is None or state.now - last >= period:
            reasons.append(f"schedule: every {t.every}, last at {last.isoformat() if last else 'never'}")
    return RetrainDecision(bool(reasons), reasons, target)


def load_policy(path: str | Path) -> tuple[RetrainPolicy, Path]:
    """Read a policy YAML; returns it and the folder its relative paths are resolved against.

    Raises:
        ConfigError: missing file, bad YAML, or a field that is wrong (named).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"policy file {p} does not exist")
    doc = load_yaml(p, "retraining policy")
    try:
        return RetrainPolicy.model_validate(doc), p.parent
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{p}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


def latest_dataset_version(ref: str) -> tuple[str, str]:
    """(reference to train on, version string) of the newest version of dataset ``ref``.

    For a gpuyard dataset both are the newest version of ``ref``'s dataset with ``ref``'s split
    selection kept (``digits@3f2a#split=train,val`` -> ``digits@<newest id>#split=train,val``): the
    retrain reads the same rows of the new version as production read of its own, and the version
    string compares equal to production's recorded one when nothing new arrived.

    Raises:
        NotFoundError: no such dataset. ConfigError: the newest version lacks a selected split.
    """
    from gpuyard.models.datasets import load_dataset, pin_dataset

    if ref.startswith(("sklearn:", "npz:")):
        return ref, load_dataset(ref).version
    parsed = DatasetRef.parse(ref)
    newest = pin_dataset(str(DatasetRef(parsed.name, None, parsed.splits)))
    return newest, newest


def on_drift_alert(model_name: str, version: int, alerts: list[dict[str, Any]]) -> dict[str, Any]:
    """Serving's hook: record drift alerts as a model event; the next policy pass acts on them."""
    from gpuyard.models.registry import record_event
    from gpuyard.store import get_store

    summary = [{k: a.get(k) for k in ("kind", "feature", "metric", "value", "threshold")} for a in alerts]
    with get_store().session() as s:
        record_event(s, model_name, version, "drift_alert", {"alerts": summary})
    return {"recorded": len(alerts), "action": "queued for the retraining policy"}


def gather_state(policy: RetrainPolicy, dataset_ref: str) -> tuple[PolicyState, str]:
    """Snapshot the registry, the dataset catalog and the model's events; also the ref to train on."""
    from sqlalchemy import select

    from gpuyard.models.registry import get_version
    from gpuyard.store import get_store
    from gpuyard.store.tables.models import ModelEventRow

    try:
        prod = get_version(f"{policy.model}@production")
    except NotFoundError:
        prod = None
    train_ref, latest = latest_dataset_version(dataset_ref)
    with get_store().read() as s:
        events = list(
            s.scalars(
                select(ModelEventRow)
                .where(ModelEventRow.name == policy.model)
                .where(ModelEventRow.action.in_(("retrain", "drift_alert", "promoted")))
            )
        )
    retrain_events = sorted((e for e in events if e.action == "retrain"), key=lambda e: e.at)
    retrains = [e.at for e in retrain_events]
    promoted = [e.at for e in events if e.action == "promoted" and prod and e.version == prod.version]
    alerts = [{"at": e.at, "version": e.version, **e.detail} for e in events if e.action == "drift_alert"]
    state = PolicyState(
        now=utcnow(),
        production_version=prod.version if prod else None,
        production_dataset_version=prod.dataset_version if prod else None,
        production_since=max(promoted) if promoted else (prod.created_at if prod else None),
        latest_dataset_version=latest,
        last_retrain_at=max(retrains) if retrains else None,
        last_retrain_dataset_version=retrain_events[-1].detail.get("dataset_version")
        if retrain_events
        else None,
        drift_alerts=alerts,
    )
    return state, train_ref


def run_policy(path: str | Path, *, dry_run: bool = False) -> dict[str, Any]:
    """One pass of the policy in ``path``: decide, and when due, train -> evaluate -> register -> promote.

    Returns:
        ``{"decision": ..., "run_id", "challenger", "promotion"}`` (only the decision on a dry run or
        when nothing is due).
    """
    from gpuyard.models.fit import fit
    from gpuyard.models.promote import promote
    from gpuyard.models.registry import get_version, record_event, register_from_run, set_stage
    from gpuyard.models.spec import load_spec
    from gpuyard.store import get_store

    policy, base = load_policy(path)
    spec_path = Path(policy.spec) if Path(policy.spec).is_absolute() else base / policy.spec
    spec = load_spec(spec_path)
    state, train_ref = gather_state(policy, policy.dataset or spec.dataset)
    decision = decide(policy, state)
    out: dict[str, Any] = {"decision": decision.to_json()}
    if not decision.retrain or dry_run:
        return out
    params: dict[str, Any] = {}
    if policy.params_from == "production" and state.production_version is not None:
        params = dict(get_version(f"{policy.model}:{state.production_version}").lineage.get("params") or {})
        params.pop("trainer", None)
    spec = spec.model_copy(update={"dataset": train_ref})
    result, _ = fit(spec, params, kind="retrain", name=f"{spec.name}-retrain")
    challenger = register_from_run(policy.model, result.run_id, description="; ".join(decision.reasons))
    set_stage(challenger.ref, ModelStage.STAGING)
    promotion = promote(challenger.ref, metric=policy.metric)
    out |= {"run_id": result.run_id, "challenger": challenger.ref, "promotion": promotion.to_json()}
    with get_store().session() as s:
        record_event(
            s,
            policy.model,
            challenger.version,
            "retrain",
            {
                "reasons": decision.reasons,
                "run_id": result.run_id,
                "promoted": promotion.promoted,
                "dataset_version": decision.dataset_version,
            },
        )
    return out
