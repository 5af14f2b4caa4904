"""Placement: gang, best fit, NVLink domains, leaf switches, GPU types, health exclusion, fragmentation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuyard.scheduler.placement import ClusterState, NodeSpec, fragmentation, place, uniform_cluster

pytestmark = pytest.mark.unit


def test_single_node_job_goes_to_the_fullest_node_that_fits() -> None:
    state = ClusterState(uniform_cluster(3, 8))
    state.free[:] = [8, 3, 5]
    p = place(state, 3)
    assert p is not None and p.nodes == ((1, 3),)
    p = place(state, 4)
    assert p is not None and p.nodes == ((2, 4),)  # node 0 stays whole for an 8-GPU job


def test_gang_is_all_or_nothing() -> None:
    state = ClusterState(uniform_cluster(2, 8))
    state.free[:] = [3, 4]
    assert place(state, 8) is None  # 7 free GPUs in total: no partial placement
    assert place(state, 7) is not None
    assert place(state, 7, multi_node=False) is None


def test_multi_node_job_uses_fewest_nodes_under_one_leaf() -> None:
    state = ClusterState(uniform_cluster(8, 8, nodes_per_leaf=4))
    state.free[:] = [8, 8, 2, 2, 8, 8, 8, 0]
    p = place(state, 16)
    assert p is not None
    leaves = {state.leaf[n] for n, _ in p.nodes}
    assert len(p.nodes) == 2 and len(leaves) == 1
    p = place(state, 24)  # leaf 1 holds 24 free GPUs on three whole nodes
    assert p is not None and sorted(n for n, _ in p.nodes) == [4, 5, 6]


def test_job_spills_across_leaves_only_when_no_leaf_holds_it() -> None:
    state = ClusterState(uniform_cluster(4, 8, nodes_per_leaf=2))
    state.free[:] = [8, 4, 8, 4]
    p = place(state, 16)
    assert p is not None and sorted(n for n, _ in p.nodes) == [0, 2]
    assert "across" in p.how


def test_job_stays_inside_one_nvlink_domain_when_it_fits() -> None:
    # NVL72-like: domains of 4 nodes x 4 GPUs; domain 0 is busier, domain 1 empty.
    nodes = uniform_cluster(8, 4, nodes_per_domain=4, nodes_per_leaf=8)
    state = ClusterState(nodes)
    state.free[:] = [4, 4, 2, 2, 4, 4, 4, 4]
    p = place(state, 12)
    assert p is not None
    assert len({state.domain[n] for n, _ in p.nodes}) == 1
    assert {state.domain[n] for n, _ in p.nodes} == {0}  # the fullest domain that still fits


def test_gpu_type_and_health_are_respected() -> None:
    nodes = [
        NodeSpec("a", 8, "H100", leaf="l", excluded=frozenset({0, 1, 2})),
        NodeSpec("b", 8, "A100", leaf="l"),
    ]
    state = ClusterState(nodes)
    assert state.total_gpus == 13
    p = place(state, 6, gpu_type="H100")
    assert p is None  # 5 healthy H100s only
    p = place(state, 5, gpu_type="H100")
    assert p is not None and p.nodes == ((0, 5),)
    assert place(state, 1, gpu_type="MI300X") is None
    assert state.max_gpus("H100") == 5 and state.max_gpus("A100", multi_node=False) == 8


def test_cpu_only_jobs_use_cpu_slots() -> None:
    state = ClusterState([NodeSpec("local", 0, cpus=2)])
    p = place(state, 0, cpus=2)
    assert p is not None and p.cpus == 2
    state.take(p)
    assert place(state, 0, cpus=1) is None
    state.release(p)
    assert place(state, 0, cpus=1) is not None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([1, 1, 1, 2, 4, 8, 16]), min_size=1, max_size=40))
def test_placements_never_oversubscribe(sizes: list[int]) -> None:
    state = ClusterState(uniform_cluster(6, 8, nodes_per_leaf=3))
    for g in sizes:
        p = place(state, g)
        if p is None:
            assert g > state.free_gpus or g <= 8  # multi-node jobs are refused only when GPUs are short
            continue
        assert p.gpus == g
        state.take(p)
        assert (state.free >= 0).all()


def test_best_fit_keeps_fragmentation_lower_than_first_fit() -> None:
    sizes = [1, 3, 2, 1, 4, 1, 2, 3, 1, 1]
    state = ClusterState(uniform_cluster(4, 8))
    for g in sizes:
        p = place(state, g)
        assert p is not None
        state.take(p)
    ours = fragmentation(state)
    first = ClusterState(uniform_cluster(4, 8))
    for i, g in enumerate(sizes):  # first fit: round-robin over nodes, the way a naive spreader does
        node = i % 4
        first.free[node] -= g
    assert ours < fragmentation(first)
    assert int((state.free == 8).sum()) == 1  # 19 GPUs packed into 3 nodes: the 4th stays whole
