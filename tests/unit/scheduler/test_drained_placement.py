"""Placement on a cluster with drained nodes: nothing new goes there and their free GPUs do not count."""

from __future__ import annotations

import pytest

from gpuyard.scheduler.placement import ClusterState, NodeSpec, place, uniform_cluster

pytestmark = pytest.mark.unit


def test_a_drained_node_gets_no_job_even_as_the_best_fit() -> None:
    state = ClusterState(uniform_cluster(3, 8))
    state.free[:] = [2, 8, 8]  # node 0 is the best fit for a 2-GPU job
    assert place(state, 2).nodes == ((0, 2),)  # type: ignore[union-attr]
    state.set_drained({0})
    assert place(state, 2).nodes[0][0] != 0  # type: ignore[union-attr]
    assert state.free_gpus == 16
    state.set_drained({0, 1, 2})
    assert place(state, 1) is None and state.free_gpus == 0
    state.set_drained(set())
    assert place(state, 2).nodes == ((0, 2),)  # type: ignore[union-attr]


def test_multi_node_jobs_and_cpu_jobs_avoid_drained_nodes() -> None:
    state = ClusterState(uniform_cluster(4, 8, nodes_per_leaf=2))
    state.set_drained({1})
    p = place(state, 24)
    assert p is not None and 1 not in {n for n, _ in p.nodes} and p.gpus == 24
    assert place(state, 32) is None  # 32 GPUs exist, but 8 are on the drained node
    cpu = ClusterState([NodeSpec("a", 0, cpus=4), NodeSpec("b", 0, cpus=2)])
    cpu.set_drained({1})
    assert place(cpu, 0, cpus=2).nodes == ((0, 0),)  # type: ignore[union-attr]


def test_a_copy_keeps_the_drained_nodes() -> None:
    state = ClusterState(uniform_cluster(2, 4))
    state.set_drained({0})
    work = state.copy()
    assert place(work, 4).nodes == ((1, 4),)  # type: ignore[union-attr]


def test_a_job_avoiding_a_node_is_placed_elsewhere_and_others_still_use_it() -> None:
    from gpuyard.scheduler.policies import make_policy
    from gpuyard.scheduler.queue import JobQueue, QueuedJob

    state = ClusterState(uniform_cluster(2, 4))
    state.free[:] = [2, 4]  # node 0 is every 2-GPU job's best fit
    policy = make_policy("fifo")
    queue = JobQueue(policy.key)
    queue.add(QueuedJob(id=1, gpus=2, avoid=frozenset({0}), enqueued_at=1.0))
    queue.add(QueuedJob(id=2, gpus=2, enqueued_at=2.0))
    starts = {j.id: p.nodes for j, p in policy.decide(state, queue, [], now=3.0).starts}
    assert starts == {1: ((1, 2),), 2: ((0, 2),)}
    assert not state.drained.any()  # the avoided node is drained for that job's placement only
    # With only the avoided node free, it waits.
    state.free[:] = [4, 0]
    queue = JobQueue(policy.key)
    queue.add(QueuedJob(id=1, gpus=2, avoid=frozenset({0}), enqueued_at=1.0))
    assert policy.decide(state, queue, [], now=3.0).starts == []
