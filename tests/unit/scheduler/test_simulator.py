"""The simulator: trace formats, metrics that add up, and policy effects on a small synthetic trace."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import POLICIES, make_policy
from gpuyard.scheduler.simulator import simulate
from gpuyard.scheduler.trace import TraceJob, load_trace

pytestmark = pytest.mark.unit


def _trace(n: int = 300) -> list[TraceJob]:
    # Bursty arrivals, heavy-tailed durations, mixed sizes: a queue forms and order matters.
    return [
        TraceJob(
            i,
            submit=(i // 10) * 600.0,
            duration=60.0 * (1 + (i * 7919) % 97) ** 1.5 / 10,
            gpus=[1, 1, 1, 2, 4, 8][i % 6],
            team=f"t{i % 3}",
        )
        for i in range(n)
    ]


def test_every_policy_finishes_every_job_and_metrics_are_consistent() -> None:
    trace = _trace()
    for name in POLICIES:
        r = simulate(trace, uniform_cluster(2, 8), make_policy(name))
        assert r.jobs == len(trace) and r.rejected == 0
        assert 0 < r.utilization <= 1.0
        assert r.avg_queue_s <= r.avg_jct_s and r.median_jct_s <= r.p99_jct_s
        assert set(r.teams) == {"t0", "t1", "t2"}
        busy = sum(t["gpu_hours"] for t in r.teams.values()) * 3600
        assert busy >= sum(j.duration * j.gpus for j in trace) - 1e-6  # preemption only adds work


def test_shortest_first_beats_fifo_and_oracle_beats_estimates() -> None:
    trace = _trace()
    jct = {
        n: simulate(trace, uniform_cluster(2, 8), make_policy(n)).avg_jct_s
        for n in ("fifo", "sef", "sjf-oracle")
    }
    assert jct["sjf-oracle"] < jct["fifo"]
    assert jct["sjf-oracle"] <= jct["sef"] * 1.05


def test_jobs_larger_than_the_cluster_are_rejected_not_queued_forever() -> None:
    trace = [TraceJob(0, 0, 10, 4), TraceJob(1, 0, 10, 64)]
    r = simulate(trace, uniform_cluster(1, 8), make_policy("fifo"))
    assert r.jobs == 1 and r.rejected == 1


def test_load_generic_and_philly_formats(tmp_path: Path) -> None:
    generic = tmp_path / "g.csv"
    with generic.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["submit_time", "duration", "num_gpus", "team", "priority"])
        w.writerows([[100, 5, 2, "x", 3], [40, 7, 1, "", ""]])
    jobs = load_trace(generic)
    assert [(j.submit, j.gpus, j.team, j.priority) for j in jobs] == [(0, 1, "default", 0), (60, 2, "x", 3)]
    philly = tmp_path / "p.csv"
    philly.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,11cb48\n2017-10-09 06:13:03,2951.0,2,5902.0,6214e9\n"
    )
    jobs = load_trace(philly)
    assert [(j.submit, j.team) for j in jobs] == [(0, "6214e9"), (2932.0, "11cb48")]


def test_bad_traces_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        load_trace(tmp_path / "missing.csv")
    bad = tmp_path / "b.csv"
    bad.write_text("when,how_long\n1,2\n")
    with pytest.raises(ConfigError, match="header"):
        load_trace(bad)
    bad.write_text("submit_time,duration,num_gpus\n1,abc,1\n")
    with pytest.raises(ConfigError, match=r"line 2.*duration"):
        load_trace(bad)


def test_estimator_learns_per_class_and_backs_off() -> None:
    est = RuntimeEstimator(default_s=1000)
    assert est.estimate("a", "u", 1) == 1000
    for d in (100, 110, 90):
        est.observe("a", "u", 1, d)
    for d in (5000, 5200):
        est.observe("a", "u", 8, d)
    assert 80 < est.estimate("a", "u", 1) < 120
    assert 4500 < est.estimate("a", "u", 8) < 5500
    assert est.estimate("b", "v", 1) < est.estimate("b", "v", 8)  # new team: falls back to size
    assert est.observed == 5


def test_fair_share_weights_divide_a_contended_cluster() -> None:
    # Two teams flood an 8-GPU cluster with identical 1-GPU jobs; weights 3:1 should split it ~6:2.
    trace = [TraceJob(i, submit=0.0, duration=600.0, gpus=1, team="a" if i % 2 else "b") for i in range(400)]
    policy = make_policy("fair", weights={"a": 3.0, "b": 1.0})
    r = simulate(trace, uniform_cluster(1, 8), policy)
    # While both teams still wait, a finishes three jobs for each of b's: compare average queueing.
    assert r.teams["a"]["avg_queue_s"] < r.teams["b"]["avg_queue_s"]
    even = simulate(trace, uniform_cluster(1, 8), make_policy("fair"))
    assert abs(even.teams["a"]["avg_queue_s"] - even.teams["b"]["avg_queue_s"]) < 0.1 * even.avg_queue_s


def test_srtf_oracle_preempts_a_long_job_for_short_ones_and_backfill_beats_fifo() -> None:
    # One 8-GPU job of 50,000 s holds the node; ten short 8-GPU jobs arrive after it has run an hour
    # (the simulator decides at events only). Without preemption they wait for it; the preemptive
    # oracle preempts it and runs them.
    trace = [TraceJob(0, 0.0, 50_000.0, 8)] + [TraceJob(i, 3600.0 + i, 600.0, 8) for i in range(1, 11)]
    jct = {
        n: simulate(trace, uniform_cluster(1, 8), make_policy(n)).avg_jct_s
        for n in ("sjf-oracle", "srtf-oracle")
    }
    assert jct["srtf-oracle"] < 0.5 * jct["sjf-oracle"]
    r = simulate(trace, uniform_cluster(1, 8), make_policy("srtf-oracle"))
    assert r.preemptions >= 1 and r.jobs == 11
    mixed = _trace()
    backfill = simulate(mixed, uniform_cluster(2, 8), make_policy("fifo-backfill")).avg_jct_s
    assert backfill < simulate(mixed, uniform_cluster(2, 8), make_policy("fifo")).avg_jct_s
