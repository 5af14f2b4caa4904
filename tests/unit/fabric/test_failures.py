"""Failure model and expected ETTR: the Llama 3 rates, the exact model against a simulation, the best
interval against Young and Daly, and `gpuyard plan`'s ETTR output."""

from __future__ import annotations

import json
import math
import random

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError
from gpuyard.fabric.failures import (
    LLAMA3_405B,
    FailureModel,
    best_interval,
    daly_interval,
    ettr,
    plan_ettr,
    young_interval,
)
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.planner import checkpoint_stall_s, expected_ettr
from gpuyard.fabric.presets import load_cluster

pytestmark = pytest.mark.unit


def test_llama3_rates_give_back_419_interruptions_in_54_days_at_16k_gpus() -> None:
    per_day = LLAMA3_405B.rate_per_hour(16384, 8) * 24
    assert per_day * 54 == pytest.approx(419)
    assert LLAMA3_405B.mtbf_s(16384) / 3600 == pytest.approx(3.09, abs=0.01)
    # GPU causes are 268 of the 419 (the paper's 58.7%): per GPU, per node as the rest.
    assert 16384 * LLAMA3_405B.gpu_per_hour * 24 * 54 == pytest.approx(268)
    # Smaller jobs fail less often, and a partial node counts as a whole one.
    assert LLAMA3_405B.mtbf_s(1024) == pytest.approx(16 * LLAMA3_405B.mtbf_s(16384))
    assert LLAMA3_405B.rate_per_hour(9) == LLAMA3_405B.rate_per_hour(16) - 7 * LLAMA3_405B.gpu_per_hour


def _simulated_ettr(
    interval: float, ckpt: float, restart: float, mtbf: float, work: float, seed: int
) -> float:
    """Train ``work`` seconds with exponential failures that strike anywhere (work, checkpoint, restart)."""
    rng = random.Random(seed)
    wall = done = 0.0
    next_failure = rng.expovariate(1 / mtbf)
    while done < work:
        segment = min(interval, work - done) + ckpt
        if next_failure >= segment:  # the segment and its checkpoint complete
            wall += segment
            next_failure -= segment
            done += segment - ckpt
            continue
        wall += next_failure  # lost: the partial segment; then restart until one completes
        while True:
            next_failure = rng.expovariate(1 / mtbf)
            if next_failure >= restart:
                wall += restart
                next_failure -= restart
                break
            wall += next_failure
    return work / wall


@pytest.mark.parametrize(
    ("interval", "ckpt", "restart", "mtbf"), [(1800, 60, 600, 3 * 3600), (300, 5, 120, 1800)]
)
def test_the_exact_model_matches_a_simulation(
    interval: float, ckpt: float, restart: float, mtbf: float
) -> None:
    expected = ettr(interval, ckpt, restart, mtbf)
    simulated = _simulated_ettr(interval, ckpt, restart, mtbf, work=20000 * mtbf, seed=7)
    assert simulated == pytest.approx(expected, abs=0.005)


@pytest.mark.parametrize(
    ("ckpt", "mtbf"), [(2.8, 11135.0), (60.0, 11135.0), (60.0, 178000.0), (300.0, 3600.0)]
)
def test_best_interval_maximises_ettr_and_agrees_with_young_and_daly(ckpt: float, mtbf: float) -> None:
    best = best_interval(ckpt, mtbf)
    top = ettr(best, ckpt, 600, mtbf)
    for factor in (0.8, 0.95, 1.05, 1.25):
        assert ettr(best * factor, ckpt, 600, mtbf) < top
    # Daly's higher-order estimate is within 1% of the optimum; Young's first order within 5% while
    # the checkpoint is small against the MTBF (it overshoots by 15% at C/M = 1/12).
    assert daly_interval(ckpt, mtbf) == pytest.approx(best, rel=0.01)
    assert young_interval(ckpt, mtbf) == pytest.approx(best, rel=0.05 if ckpt / mtbf < 0.01 else 0.2)


def test_edges_no_failures_free_checkpoints_and_bad_input() -> None:
    never = FailureModel("none", 0.0, 0.0)
    assert math.isinf(never.mtbf_s(8))
    assert ettr(900, 100, 600, math.inf) == pytest.approx(0.9)
    assert plan_ettr(8, 8, 10, 600, never).best_ettr == 1.0
    free = plan_ettr(16384, 8, 0.0, 600)
    assert free.best_interval_s == 0 and free.best_ettr == pytest.approx(math.exp(-600 / free.mtbf_s))
    with pytest.raises(ConfigError):
        ettr(0, 1, 1, 10)
    with pytest.raises(ConfigError):
        FailureModel("bad", -1.0, 0.0)
    with pytest.raises(ConfigError):
        plan_ettr(8, 8, -1, 0)


def test_ettr_falls_with_scale_and_with_the_restart_cost() -> None:
    small, large = plan_ettr(1024, 8, 60, 600), plan_ettr(16384, 8, 60, 600)
    assert small.best_ettr > large.best_ettr and small.best_interval_s > large.best_interval_s
    assert plan_ettr(16384, 8, 60, 60).best_ettr > large.best_ettr
    assert large.best_ettr >= max(e for _, e in large.by_interval)


def test_the_planner_costs_a_checkpoint_from_the_model_state() -> None:
    model, cluster = PRESETS["llama3-405b"], load_cluster("dgx-h100")
    # 405B x 14 bytes over 2,048 nodes: capped by the storage's 2 TB/s.
    assert checkpoint_stall_s(model, 16384, 8) == pytest.approx(model.params * 14 / 2e12)
    assert checkpoint_stall_s(model, 64, 8) == pytest.approx(model.params * 14 / 16e9)
    plan = expected_ettr(model, cluster, 16384)
    assert 0.9 < plan.best_ettr < 0.95  # the run reports "higher than 90%" effective training time
    assert plan.notes and "TB of state" in plan.notes[0]
    assert expected_ettr(model, cluster, 16384, checkpoint_s=60).checkpoint_s == 60


def test_cli_plan_shows_the_expected_ettr(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--json", "--top", "1", "--checkpoint-s", "30", "--restart-s", "300"])
    assert info.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"model", "cluster", "gpus", "plans", "warnings", "considered", "fitting"} <= set(doc)
    got = doc["ettr"]
    assert (got["gpus"], got["nodes"], got["checkpoint_s"], got["restart_s"]) == (64, 8, 30, 300)
    assert got["expected_ettr"] == pytest.approx(plan_ettr(64, 8, 30, 300).best_ettr)
    assert [row["interval_s"] for row in got["by_interval"]][:2] == [300, 600]
    with pytest.raises(SystemExit) as info:
        main([*args, "--top", "1"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "expected ETTR" in out and "at 64 GPUs" in out and "Llama 3" in out
