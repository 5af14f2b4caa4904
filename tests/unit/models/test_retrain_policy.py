"""The retraining policy is a pure function of a state snapshot."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpuyard.errors import ConfigError
from gpuyard.models.retrain import PolicyState, RetrainPolicy, decide, parse_duration

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 22, 12, tzinfo=timezone.utc)


def state(**kw) -> PolicyState:
    base = dict(
        now=NOW,
        production_version=3,
        production_dataset_version="d@v1",
        production_since=NOW - timedelta(days=1),
        latest_dataset_version="d@v1",
        last_retrain_at=None,
        drift_alerts=[],
    )
    return PolicyState(**{**base, **kw})


def policy(**kw) -> RetrainPolicy:
    return RetrainPolicy.model_validate({"model": "m", "spec": "s.yaml", **kw})


def test_nothing_new_means_no_retrain() -> None:
    d = decide(policy(), state())
    assert not d.retrain and d.reasons == []


def test_no_production_model_bootstraps() -> None:
    assert decide(policy(), state(production_version=None)).retrain


def test_new_dataset_version_triggers_once() -> None:
    d = decide(policy(), state(latest_dataset_version="d@v2"))
    assert d.retrain and "new dataset version d@v2" in d.reasons[0] and d.dataset_version == "d@v2"
    # already retrained on v2 (challenger refused): not again
    again = state(
        latest_dataset_version="d@v2",
        last_retrain_at=NOW - timedelta(hours=2),
        last_retrain_dataset_version="d@v2",
    )
    assert not decide(policy(), again).retrain
    assert not decide(
        policy(triggers={"new_dataset_version": False}), state(latest_dataset_version="d@v2")
    ).retrain


def test_drift_alerts_after_the_last_retrain_and_outside_cooldown() -> None:
    alert = {"at": NOW - timedelta(minutes=5)}
    assert decide(policy(), state(drift_alerts=[alert])).retrain
    old = {"at": NOW - timedelta(days=2)}  # before production went live
    assert not decide(policy(), state(drift_alerts=[old])).retrain
    recent = state(drift_alerts=[alert], last_retrain_at=NOW - timedelta(minutes=10))
    assert not decide(policy(cooldown="1h"), recent).retrain
    assert decide(policy(cooldown="5m"), recent).retrain
    assert not decide(policy(triggers={"drift": False}), state(drift_alerts=[alert])).retrain


def test_schedule() -> None:
    assert decide(policy(triggers={"every": "12h"}), state()).retrain  # production is a day old
    assert not decide(policy(triggers={"every": "2d"}), state()).retrain
    reasons = decide(policy(triggers={"every": "1h"}), state(latest_dataset_version="d@v9")).reasons
    assert len(reasons) == 2  # every reason that holds is given


@pytest.mark.parametrize("text", ["soon", "-1h", "0", "3y"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)


def test_bad_policy_fields() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="every"):
        policy(triggers={"every": "weekly"})
    with pytest.raises(ValidationError, match="params_from"):
        policy(params_from="best")
    assert parse_duration("90s") == 90 and parse_duration("2w") == 14 * 86400
