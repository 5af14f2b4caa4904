"""Fabric-aware placement: the spread-or-wait decision, policies that use it, jobs without a workload."""

from __future__ import annotations

import random

import pytest

from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.placement_cost import Workload
from gpuyard.fabric.planner import Knobs
from gpuyard.fabric.presets import load_cluster
from gpuyard.scheduler.fabric_placement import FabricPlacer, choose, expected_wait, shape_of
from gpuyard.scheduler.nodes import nodes_from_fabric, with_network
from gpuyard.scheduler.placement import ClusterState, Placement, place
from gpuyard.scheduler.policies import POLICIES, make_policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob

pytestmark = pytest.mark.unit

NOW = 10_000.0
MODEL = ModelSpec("gpt-1.3b", 24, 2048, 16, 16, 8192, 51200, 2048, tied_embeddings=True)
KNOBS = Knobs(cp=1, micro_batch=1, virtual_stages=1, recompute="selective", zero=1)
WORKLOAD = Workload(MODEL, 32, 2048, KNOBS)


def _fabric() -> Cluster:
    # Four DGX A100 nodes, two per leaf switch, a 4:1 oversubscribed spine.
    return with_network(load_cluster("dgx-a100"), 2, 4.0)


def _state() -> tuple[ClusterState, list[RunningJob]]:
    """Nodes 0-1 under leaf 0, 2-3 under leaf 1; 4 GPUs free on node 0 and on node 3, the rest busy."""
    state = ClusterState(nodes_from_fabric(_fabric(), 4))
    busy = [(0, 4, NOW + 100), (1, 8, NOW + 5000), (2, 8, NOW + 5000), (3, 4, NOW + 5000)]
    running = []
    for i, (node, gpus, end) in enumerate(busy):
        p = Placement(((node, gpus),), "running")
        state.take(p)
        running.append(RunningJob(100 + i, gpus, "t", 0, NOW - 10, end, p))
    return state, running


def _job(estimate: float, waited: float = 0.0, workload: Workload | None = WORKLOAD) -> QueuedJob:
    at = NOW - waited
    return QueuedJob(1, 8, estimate=estimate, enqueued_at=at, submit_time=at, workload=workload)


def _choose(job: QueuedJob, max_wait: float = 600.0):  # type: ignore[no-untyped-def]
    state, running = _state()
    p = place(state, job.gpus)
    assert p is not None and len(p.nodes) == 2  # 4 + 4 GPUs over two leaves: the only way to start now
    return choose(FabricPlacer(_fabric(), max_wait), state, job, WORKLOAD, p, running, NOW)


def test_waits_when_the_slowdown_outweighs_the_expected_wait() -> None:
    choice = _choose(_job(estimate=36_000.0))
    assert choice.action == "wait"
    assert choice.expected_wait_s == pytest.approx(100.0)  # node 0 frees its other 4 GPUs then
    assert choice.slowdown_cost_s > choice.expected_wait_s
    p = choice.placement.predicted
    assert p is not None and p.step_s > p.consolidated_s and p.choice == "wait"
    assert "2 nodes over 2 leaves: predicted step" in choice.note
    assert "waiting up to 600 s for one node" in choice.note


def test_the_wait_note_does_not_change_as_the_clock_runs() -> None:
    # The service records the note as an event only when it changes: no per-tick countdown in it.
    state, running = _state()
    placer = FabricPlacer(_fabric())
    p = place(state, 8)
    assert p is not None
    notes = {choose(placer, state, _job(36_000.0), WORKLOAD, p, running, NOW + dt).note for dt in (0, 30, 60)}
    assert len(notes) == 1


def test_spreads_when_the_wait_costs_more_than_the_slowdown() -> None:
    choice = _choose(_job(estimate=60.0))
    assert choice.action == "start" and choice.slowdown_cost_s < choice.expected_wait_s
    assert choice.placement.predicted is not None and choice.placement.predicted.choice == "spread"
    assert "spreading now" in choice.placement.how


def test_never_waits_beyond_the_cap() -> None:
    capped = _choose(_job(estimate=36_000.0, waited=601.0))
    assert capped.action == "start" and "the cap" in capped.note
    # A consolidation expected only after the cap is not waited for either.
    assert _choose(_job(estimate=36_000.0), max_wait=50.0).action == "start"


def test_a_consolidated_placement_starts_at_once_with_its_prediction() -> None:
    state = ClusterState(nodes_from_fabric(_fabric(), 4))
    job = _job(estimate=36_000.0)
    p = place(state, 8)
    assert p is not None
    choice = choose(FabricPlacer(_fabric()), state, job, WORKLOAD, p, [], NOW)
    assert choice.action == "start" and choice.placement.predicted is not None
    assert choice.placement.predicted.choice == "consolidated" and choice.placement.nodes == p.nodes


def test_expected_wait_follows_running_jobs_ends_and_the_horizon() -> None:
    state, running = _state()
    placer = FabricPlacer(_fabric())
    best = placer.step(WORKLOAD, shape_of(state, placer.ideal(state, 8, None)))  # type: ignore[arg-type]
    assert best is not None
    assert expected_wait(placer, state, _job(1.0), WORKLOAD, running, NOW, 1e9, best) == pytest.approx(100.0)
    assert expected_wait(placer, state, _job(1.0), WORKLOAD, running, NOW, 50.0, best) == float("inf")


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "sjf-oracle"])
def test_policies_keep_the_waiting_job_queued_and_say_why(name: str) -> None:
    state, running = _state()
    queue = JobQueue(make_policy(name).key)
    queue.add(_job(estimate=36_000.0))
    aware = make_policy(name, placer=FabricPlacer(_fabric()))
    decision = aware.decide(state, queue, running, NOW, preempt=False)
    assert decision.starts == [] and "waiting up to" in decision.waits[1]
    spread = make_policy(name).decide(state, queue, running, NOW, preempt=False)
    assert [j.id for j, _ in spread.starts] == [1]  # topology-only placement starts it spread


@pytest.mark.parametrize("seed", range(6))
def test_jobs_without_a_workload_are_placed_exactly_as_before(seed: int) -> None:
    rng = random.Random(seed)
    state = ClusterState(nodes_from_fabric(_fabric(), 4))
    state.free[:] = [rng.randint(0, 8) for _ in range(4)]
    for name in ("fifo", "priority", "sef", "las", "fair"):
        queue = JobQueue(make_policy(name).key)
        for i in range(8):
            queue.add(QueuedJob(i, rng.choice([1, 2, 4, 8, 12, 16]), team=f"t{i % 2}", submit_time=float(i)))
        plain = make_policy(name).decide(state, queue, [], NOW)
        aware = make_policy(name, placer=FabricPlacer(_fabric())).decide(state, queue, [], NOW)
        assert [(j.id, p) for j, p in aware.starts] == [(j.id, p) for j, p in plain.starts]
        assert aware.waits == {}
