"""Policies: FIFO blocking, backfill behind a reservation, fair share with preemption, SEF, LAS, oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.placement import ClusterState, Placement, uniform_cluster
from gpuyard.scheduler.policies import POLICIES, FairShare, make_policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob

pytestmark = pytest.mark.unit


def _queue(policy_name: str, jobs: list[QueuedJob]) -> tuple[object, JobQueue]:
    policy = make_policy(policy_name)
    q = JobQueue(policy.key)
    for j in jobs:
        q.add(j)
    return policy, q


def _running(
    state: ClusterState,
    jid: int,
    node: int,
    gpus: int,
    team: str = "a",
    end: float = 100.0,
    started: float = 0.0,
) -> RunningJob:
    p = Placement(((node, gpus),), "test")
    state.take(p)
    return RunningJob(jid, gpus, team, 0, started, end, p)


def test_fifo_blocks_behind_the_head_job() -> None:
    state = ClusterState(uniform_cluster(1, 8))
    run = [_running(state, 99, 0, 6)]
    policy, q = _queue("fifo", [QueuedJob(1, 4, submit_time=0), QueuedJob(2, 1, submit_time=1)])
    d = policy.decide(state, q, run, now=10)  # type: ignore[attr-defined]
    assert d.starts == []


def test_backfill_never_delays_the_reserved_head_job() -> None:
    state = ClusterState(uniform_cluster(1, 8))
    run = [_running(state, 99, 0, 6, end=100.0)]  # 2 GPUs free now, 8 at t=100
    jobs = [
        QueuedJob(1, 8, priority=5, submit_time=0, estimate=50),  # head: waits for t=100
        QueuedJob(2, 1, submit_time=1, estimate=500),  # would still run at t=100: must not start
        QueuedJob(3, 1, submit_time=2, estimate=50),  # ends by t=60 < 100: backfills
    ]
    policy, q = _queue("priority", jobs)
    d = policy.decide(state, q, run, now=10)  # type: ignore[attr-defined]
    assert [j.id for j, _ in d.starts] == [3]
    assert d.reservation == (1, 100.0)


def test_backfill_may_use_gpus_the_reserved_job_does_not_need() -> None:
    state = ClusterState(uniform_cluster(2, 8))
    run = [_running(state, 99, 0, 8, end=100.0), _running(state, 98, 1, 4, end=1000.0)]
    jobs = [QueuedJob(1, 8, priority=5, estimate=10), QueuedJob(2, 4, estimate=5000)]
    policy, q = _queue("priority", jobs)
    d = policy.decide(state, q, run, now=0)  # type: ignore[attr-defined]
    # At t=100 node 0 frees 8 for the head; the 4 free on node 1 are extra: the long job may use them.
    assert [j.id for j, _ in d.starts] == [2]


def test_fair_share_serves_the_most_under_served_team_first() -> None:
    state = ClusterState(uniform_cluster(1, 4))
    run = [_running(state, 90, 0, 2, team="a")]
    jobs = [
        QueuedJob(1, 1, team="a", submit_time=0),
        QueuedJob(2, 1, team="b", submit_time=5),
        QueuedJob(3, 1, team="b", submit_time=6),
    ]
    policy, q = _queue("fair", jobs)
    d = policy.decide(state, q, run, now=10)  # type: ignore[attr-defined]
    assert [j.id for j, _ in d.starts] == [2, 3]  # b is at 0 of its 2, a already has its 2


def test_fair_share_lends_idle_gpus_and_reclaims_them_by_preemption() -> None:
    state = ClusterState(uniform_cluster(1, 4))
    policy = FairShare({"a": 1, "b": 1}, min_run_s=60, min_wait_s=0)
    q = JobQueue(policy.key)
    q.add(QueuedJob(1, 4, team="a"))
    d = policy.decide(state, q, [], now=0)
    assert [j.id for j, _ in d.starts] == [1]  # b is idle: a may borrow the whole node
    run = [_running(state, 1, 0, 4, team="a", started=0)]
    q = JobQueue(policy.key)
    q.add(QueuedJob(2, 2, team="b", enqueued_at=100))
    assert policy.decide(state, q, run, now=30).preempt == []  # a's job has not run min_run_s yet
    assert policy.decide(state, q, run, now=200).preempt == [1]


def test_a_job_being_stopped_frees_gpus_for_the_blocked_job_no_second_victim() -> None:
    # Team a holds all 4 GPUs in 1-GPU jobs; b and c (equal shares) each wait for one GPU.
    state = ClusterState(uniform_cluster(1, 4))
    policy = FairShare({"a": 1, "b": 1, "c": 1}, min_run_s=0, min_wait_s=0)
    run = [_running(state, i, 0, 1, team="a", started=float(i)) for i in range(4)]
    q = JobQueue(policy.key)
    q.add(QueuedJob(10, 1, team="b"))
    q.add(QueuedJob(11, 1, team="c"))
    first = policy.decide(state, q, run, now=100).preempt
    assert sorted(first) == [2, 3]  # the most recently started, one for each blocked job
    # Until they exit (checkpointing), their GPUs are on their way to b and c: nobody else is preempted.
    stopping = [replace(r, stopping=r.id in first) for r in run]
    assert policy.decide(state, q, stopping, now=101).preempt == []
    # Job 3 has exited: b starts on its GPU, and job 2's GPU is still on its way to c.
    after = state.copy()
    after.release(run[3].placement)
    d = policy.decide(after, q, stopping[:3], now=102)
    assert [j.id for j, _ in d.starts] == [10] and d.preempt == []
    # A fourth team arrives (shares 1 each): a holds 2 once its stopping jobs exit, so one more victim
    # brings it to its share, and no further (its stopping jobs are not counted as still held).
    q.add(QueuedJob(12, 1, team="d"))
    assert policy.decide(state, q, stopping, now=103).preempt == [1]


def test_las_counts_gpus_of_a_job_being_stopped() -> None:
    state = ClusterState(uniform_cluster(1, 2))
    run = [_running(state, 1, 0, 1, started=0), _running(state, 2, 0, 1, started=1)]
    policy, q = _queue("las", [QueuedJob(3, 1, submit_time=50_000)])
    assert policy.decide(state, q, run, now=50_000).preempt == [2]  # type: ignore[attr-defined]
    stopping = [run[0], replace(run[1], stopping=True)]
    assert policy.decide(state, q, stopping, now=50_001).preempt == []  # type: ignore[attr-defined]


def test_fair_share_weights_set_the_shares() -> None:
    policy = FairShare({"a": 3, "b": 1})
    shares = policy.shares(ClusterState(uniform_cluster(1, 8)), ["a", "b"])
    assert shares == {"a": 6.0, "b": 2.0}


def test_fair_share_starts_jobs_in_proportion_to_weights() -> None:
    state = ClusterState(uniform_cluster(1, 8))
    policy = FairShare({"a": 3, "b": 1})
    q = JobQueue(policy.key)
    for i in range(20):
        q.add(QueuedJob(i, 1, team="a" if i % 2 else "b", submit_time=float(i)))
    d = policy.decide(state, q, [], now=100)
    started = [j.team for j, _ in d.starts]
    assert started.count("a") == 6 and started.count("b") == 2


def test_shortest_expected_first_orders_by_estimate() -> None:
    state = ClusterState(uniform_cluster(1, 1))
    jobs = [QueuedJob(1, 1, submit_time=0, estimate=900), QueuedJob(2, 1, submit_time=5, estimate=30)]
    policy, q = _queue("sef", jobs)
    d = policy.decide(state, q, [], now=10)  # type: ignore[attr-defined]
    assert [j.id for j, _ in d.starts] == [2]


def test_las_preempts_jobs_that_have_run_long_for_new_ones() -> None:
    state = ClusterState(uniform_cluster(1, 2))
    run = [_running(state, 1, 0, 2, started=0)]
    policy, q = _queue("las", [QueuedJob(2, 1, submit_time=50_000)])
    d = policy.decide(state, q, run, now=50_000)  # type: ignore[attr-defined]
    assert d.preempt == [1]  # 100,000 GPU-seconds attained: a lower level than the new job
    fresh = [RunningJob(1, 2, "a", 0, 49_990, 60_000, run[0].placement)]
    assert policy.decide(state, q, fresh, now=50_000).preempt == []  # type: ignore[attr-defined]


def test_oracle_is_refused_where_run_times_are_unknown() -> None:
    assert "sjf-oracle" in POLICIES and POLICIES["sjf-oracle"].needs_oracle
    with pytest.raises(ConfigError, match="only the simulator"):
        make_policy("sjf-oracle", allow_oracle=False)
    with pytest.raises(ConfigError, match="choose one of"):
        make_policy("lottery")


def test_policies_do_not_change_their_inputs() -> None:
    for name in POLICIES:
        state = ClusterState(uniform_cluster(2, 8))
        run = [_running(state, 99, 0, 4)]
        before = state.free.copy()
        policy, q = _queue(
            name, [QueuedJob(i, 1 + i % 3, team=f"t{i % 2}", duration=10.0 * i) for i in range(6)]
        )
        policy.decide(state, q, run, now=1000)  # type: ignore[attr-defined]
        assert (state.free == before).all() and len(q) == 6


def test_srtf_oracle_preempts_only_jobs_with_much_more_work_left() -> None:
    state = ClusterState(uniform_cluster(1, 8))
    # True remaining of a running job = expected_end - now (the simulator starts oracle jobs so).
    run = [
        _running(state, 90, 0, 4, end=50_000.0, started=0.0),  # 46,000 s left: a victim
        _running(state, 91, 0, 4, end=5_000.0, started=0.0),  # 1,000 s left: shorter than the waiter
    ]
    policy, q = _queue("srtf-oracle", [QueuedJob(1, 4, submit_time=3000, duration=600)])
    d = policy.decide(state, q, run, now=4000)  # type: ignore[attr-defined]
    assert d.starts == [] and d.preempt == [90]
    # Too early after its start (min_run_s), or not enough longer work to free 8 GPUs: nobody.
    assert policy.decide(state, q, run, now=1000).preempt == []  # type: ignore[attr-defined]
    policy8, q8 = _queue("srtf-oracle", [QueuedJob(2, 8, submit_time=3000, duration=600)])
    assert policy8.decide(state, q8, run, now=4000).preempt == []  # type: ignore[attr-defined]


def test_srtf_oracle_orders_by_true_remaining_time_and_needs_an_oracle() -> None:
    state = ClusterState(uniform_cluster(1, 1))
    jobs = [
        QueuedJob(1, 1, submit_time=0, estimate=10, duration=5000),
        QueuedJob(2, 1, submit_time=1, estimate=9000, duration=4000, attained=3900),  # 100 s left
    ]
    policy, q = _queue("srtf-oracle", jobs)
    d = policy.decide(state, q, [], now=10)  # type: ignore[attr-defined]
    assert [j.id for j, _ in d.starts] == [2]
    assert POLICIES["srtf-oracle"].needs_oracle and POLICIES["srtf-oracle"].preemptive
    with pytest.raises(ConfigError, match="needs true run times"):
        make_policy("srtf-oracle", allow_oracle=False)


def test_fifo_backfill_keeps_arrival_order_and_backfills_behind_the_head() -> None:
    state = ClusterState(uniform_cluster(1, 8))
    run = [_running(state, 99, 0, 6, end=100.0)]  # 2 GPUs free now, 8 at t=100
    jobs = [
        QueuedJob(1, 8, submit_time=0, estimate=50),  # head by arrival: reserved for t=100
        QueuedJob(2, 2, priority=9, submit_time=1, estimate=500),  # high priority, but would delay the head
        QueuedJob(3, 1, submit_time=2, estimate=50),  # ends by t=60: backfills
    ]
    policy, q = _queue("fifo-backfill", jobs)
    d = policy.decide(state, q, run, now=10)  # type: ignore[attr-defined]
    assert [j.id for j, _ in d.starts] == [3]
    assert d.reservation == (1, 100.0)
    # Plain FIFO starts nothing behind the blocked head.
    fifo, fq = _queue("fifo", jobs)
    assert fifo.decide(state, fq, run, now=10).starts == []  # type: ignore[attr-defined]
