"""Failures injected into the simulator: lost work, restarts and ETTR, checked against Daly's model."""

from __future__ import annotations

import statistics

import pytest

from gpuyard.fabric.failures import LLAMA3_405B, FailureModel, best_interval, ettr
from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import SimConfig, simulate
from gpuyard.scheduler.trace import TraceJob

pytestmark = pytest.mark.unit

DAYS = 86400.0


def _one_big_job(
    interval: float, stall: float, restart: float, seed: int, model: FailureModel | None
) -> float:
    # Llama 3's scale: one 16,384-GPU job of 54 days of work on exactly its GPUs.
    trace = [TraceJob(0, submit=0.0, duration=54 * DAYS, gpus=16384)]
    config = SimConfig(
        checkpoint_interval_s=interval,
        checkpoint_stall_s=stall,
        restart_overhead_s=restart,
        failures=model,
        failure_seed=seed,
    )
    # 64 virtual nodes of 256 GPUs place fast; the failure model still counts nodes of 8 GPUs.
    return simulate(trace, uniform_cluster(64, 256), make_policy("fifo"), config=config).ettr


def test_without_failures_nothing_is_lost() -> None:
    trace = [TraceJob(i, submit=i * 10.0, duration=3600.0, gpus=8) for i in range(20)]
    result = simulate(trace, uniform_cluster(4, 8), make_policy("fifo"))
    assert result.failures == 0 and result.ettr == 1.0 and result.lost_gpu_hours == 0.0


def test_simulated_ettr_at_16384_gpus_agrees_with_dalys_model() -> None:
    mtbf = LLAMA3_405B.mtbf_s(16384)
    stall, restart = 2.8, 600.0
    interval = best_interval(stall, mtbf)
    expected = ettr(interval, stall, restart, mtbf)
    simulated = statistics.mean(_one_big_job(interval, stall, restart, s, LLAMA3_405B) for s in range(4))
    assert expected == pytest.approx(0.926, abs=0.005)
    assert simulated == pytest.approx(expected, abs=0.015)


def test_the_best_interval_beats_checkpointing_far_more_or_far_less_often() -> None:
    mtbf = LLAMA3_405B.mtbf_s(16384)
    stall, restart = 60.0, 600.0
    best = best_interval(stall, mtbf)

    def mean(interval: float) -> float:
        return statistics.mean(_one_big_job(interval, stall, restart, s, LLAMA3_405B) for s in range(3))

    at_best = mean(best)
    assert at_best > mean(best / 10) + 0.05  # the stalls dominate
    assert at_best > mean(best * 10) + 0.05  # the lost work dominates
    # Failures during a restart do not pile up restarts: the loss per failure stays bounded.
    assert mean(best) > ettr(best, stall, restart, mtbf) - 0.02


def test_a_failure_is_requeued_or_ends_the_job_as_the_servers_exit_rules_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuyard.scheduler import simulator
    from gpuyard.scheduler.core import on_exit
    from gpuyard.scheduler.spec import JobState

    seen: list[tuple[int, int, JobState, str]] = []

    def recording(job, status):  # type: ignore[no-untyped-def]
        out = on_exit(job, status)
        seen.append((job.failures, job.spec.max_restarts, out.state, out.transitions[-1].reason))
        return out

    monkeypatch.setattr(simulator, "on_exit", recording)
    # A failure every few minutes on 8 GPUs: the 10-hour job never finishes.
    flaky = FailureModel("test", gpu_per_hour=2.0, node_per_hour=0.0)
    trace = [TraceJob(0, submit=0.0, duration=36000.0, gpus=8)]
    config = SimConfig(failures=flaky, max_restarts=2, failure_seed=1)
    result = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=config)
    # Two failures with restarts left: queued again (and run again); the third ends it failed.
    assert seen == [
        (0, 2, JobState.QUEUED, "failed (exit code 1); restart 1 of 2"),
        (1, 2, JobState.QUEUED, "failed (exit code 1); restart 2 of 2"),
        (2, 2, JobState.FAILED, "failed (exit code 1)"),
    ]
    assert result.failures == 3 and result.failed_jobs == 1 and result.jobs == 1
    # Without a limit (the default) the same job is restarted after every failure until it finishes.
    unlimited = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"), config=SimConfig(failures=flaky))
    assert unlimited.failed_jobs == 0 and unlimited.failures > 3
