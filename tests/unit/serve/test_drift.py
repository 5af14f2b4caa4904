"""Drift: PSI and KS against a reference, the sliding window, alerts once per episode, the retrain hook."""

from __future__ import annotations

import types

import numpy as np
import pytest

from gpuyard.errors import ConfigError
from gpuyard.serve.drift import DriftConfig, DriftMonitor, build_reference, compare, psi

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(0)
TRAIN = RNG.normal(size=(3000, 3)).astype(np.float32)
PREDS = (TRAIN[:, 0] > 0).astype(int)
REF = build_reference(TRAIN, PREDS, "classification", ["a", "b", "c"], "test")
CFG = DriftConfig(window=500, min_rows=100, interval_s=60)


def test_psi_is_zero_for_equal_shares_and_grows_with_shift() -> None:
    e = np.array([0.25, 0.25, 0.25, 0.25])
    assert psi(e, e) == pytest.approx(0.0)
    assert 0 < psi(e, np.array([0.3, 0.2, 0.25, 0.25])) < psi(e, np.array([0.7, 0.1, 0.1, 0.1]))


def test_same_distribution_does_not_drift() -> None:
    x = np.random.default_rng(1).normal(size=(500, 3)).astype(np.float32)
    report = compare(REF, x, (x[:, 0] > 0).astype(float), CFG)
    assert not any(f["drift_psi"] or f["drift_ks"] for f in report["features"])
    assert not report["predictions"]["drift_psi"]


def test_a_shifted_feature_and_the_predictions_it_moves_are_flagged() -> None:
    x = np.random.default_rng(2).normal(size=(500, 3)).astype(np.float32)
    x[:, 0] += 1.5  # feature a moves; b and c stay
    report = compare(REF, x, (x[:, 0] > 0).astype(float), CFG)
    by_name = {f["feature"]: f for f in report["features"]}
    assert by_name["a"]["drift_psi"] and by_name["a"]["drift_ks"]
    assert not (by_name["b"]["drift_psi"] or by_name["c"]["drift_psi"])
    assert report["predictions"]["drift_psi"]


def test_the_window_slides_and_alerts_fire_once_per_episode() -> None:
    fired: list[list[dict[str, object]]] = []
    mon = DriftMonitor(REF, CFG, on_alert=fired.append)
    rng = np.random.default_rng(3)
    assert mon.evaluate() is None  # below min_rows: no test yet
    shifted = rng.normal(size=(600, 3)).astype(np.float32) + np.array([0, 3, 0], np.float32)
    mon.observe(shifted, np.zeros(600))
    assert len(mon.snapshot()[0]) == 500  # the window keeps the newest 500 rows
    mon.evaluate()
    mon.evaluate()  # same episode: cooldown keeps it quiet
    assert len(fired) == 1
    kinds = {(a["kind"], a["feature"], a["metric"]) for a in fired[0]}
    assert ("input_drift", "b", "psi") in kinds and ("input_drift", "b", "ks") in kinds
    assert not any(a["feature"] == "a" for a in fired[0])
    # Back to normal traffic: the window refills with in-distribution rows and the tests go quiet.
    calm = rng.normal(size=(500, 3)).astype(np.float32)
    mon.observe(calm, (calm[:, 0] > 0).astype(float))
    report = mon.evaluate()
    assert report is not None and not any(f["drift_psi"] for f in report["features"])


def test_the_ring_keeps_exactly_the_newest_rows_across_wraps() -> None:
    mon = DriftMonitor(REF, DriftConfig(window=10, min_rows=10, interval_s=60))
    rows = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)
    for a, b in ((0, 4), (4, 11), (11, 12), (12, 23)):  # chunks that wrap the ring at odd places
        mon.observe(rows[a:b], rows[a:b, 0])
    x, p = mon.snapshot()
    assert sorted(x[:, 0].tolist()) == rows[-10:, 0].tolist()
    assert np.array_equal(np.sort(p), rows[-10:, 0])
    mon.observe(rows, rows[:, 0])  # more rows than the window in one call
    assert sorted(mon.snapshot()[0][:, 0].tolist()) == rows[-10:, 0].tolist()


def test_regression_predictions_use_psi_and_ks() -> None:
    y = TRAIN[:, 0] * 2.0
    ref = build_reference(TRAIN, y, "regression", ["a", "b", "c"], "test")
    report = compare(ref, TRAIN[:500], y[:500] + 5.0, CFG)
    assert report["predictions"]["drift_psi"] and report["predictions"]["drift_ks"]


@pytest.mark.parametrize("kwargs", [{"window": 5}, {"min_rows": 2000}, {"ks_alpha": 2.0}])
def test_bad_drift_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        DriftConfig(**kwargs)  # type: ignore[arg-type]


def test_retrain_hook_is_model_managements_policy_and_its_failure_is_recorded() -> None:
    from gpuyard.models.retrain import on_drift_alert
    from gpuyard.serve import alerts as alerts_mod

    model = types.SimpleNamespace(name="m", version=2)
    assert alerts_mod.run_retrain_hook.__defaults__ == (on_drift_alert,)

    calls: list[dict[str, object]] = []

    def policy(**kw: object) -> dict[str, bool]:
        calls.append(kw)
        return {"queued": True}

    alerts = [{"kind": "input_drift", "value": np.float64(0.5)}]
    out = alerts_mod.run_retrain_hook(model, alerts, policy)  # type: ignore[arg-type]
    assert out["hook"] == f"{__name__}:{policy.__qualname__}" and out["result"] == {"queued": True}
    assert calls[0]["model_name"] == "m" and calls[0]["alerts"] == [{"kind": "input_drift", "value": 0.5}]

    def broken(**_: object) -> None:
        raise RuntimeError("policy down")

    assert alerts_mod.run_retrain_hook(model, [], broken)["error"] == "policy down"  # type: ignore[arg-type]
