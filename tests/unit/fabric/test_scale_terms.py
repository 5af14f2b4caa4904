"""Scale terms of the step model (issue 31 item 2): the slowest of N GPUs, collective latency that
grows with the ring or tree, and an oversubscribed network tier, each checked where it must show."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.collectives import estimate
from gpuyard.fabric.models import PRESETS
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step, slowest_of

pytestmark = pytest.mark.unit

MODEL = PRESETS["llama3-8b"]


def _with(cluster: Cluster, **compute: float) -> Cluster:
    data = cluster.model_dump()
    data["compute"] = {**data["compute"], **compute}
    return Cluster.model_validate(data)


def test_slowest_of_n_matches_the_expected_maximum_of_normals() -> None:
    # E[max of N standard normals]: 0.5642 (2), 1.4236 (8), 2.5076 (100), 3.2414 (1024) (exact values).
    assert slowest_of(1) == 0.0
    for n, exact in ((2, 0.5642), (8, 1.4236), (100, 2.5076), (1024, 3.2414)):
        assert slowest_of(n) == pytest.approx(exact, abs=0.03)
    values = [slowest_of(2**k) for k in range(1, 16)]
    assert values == sorted(values) and values[-1] < 4.2  # grows like sqrt(2 ln N), slowly


def test_a_synchronous_step_waits_for_its_slowest_gpu() -> None:
    h100 = load_cluster("dgx-h100")
    assert h100.compute.speed_spread == pytest.approx(0.015)  # Sinha et al. SC'22: 8% span over GPUs

    def compute_s(cluster: Cluster, gpus: int) -> float:
        cfg = ParallelConfig(dp=gpus, micro_batch=1, zero=0)  # the same work per GPU at every size
        return estimate_step(MODEL, cluster, gpus, gpus, 8192, cfg).breakdown.compute_s

    small, large = compute_s(h100, 8), compute_s(h100, 8192)
    expected = (1 + 0.015 * slowest_of(8192)) / (1 + 0.015 * slowest_of(8))
    assert large / small == pytest.approx(expected, rel=1e-9)
    assert 1.03 < expected < 1.05
    even = _with(h100, speed_spread=0.0)  # identical GPUs: no penalty at any size
    assert compute_s(even, 8192) == pytest.approx(compute_s(even, 8))


def test_collective_latency_grows_with_the_ring_and_more_slowly_with_the_tree() -> None:
    a100 = load_cluster("dgx-a100")
    ring = [estimate(a100, "all_reduce", 8 * n, 4096, algorithm="ring").time_s for n in (4, 16, 64)]
    tree = [estimate(a100, "all_reduce", 8 * n, 4096, algorithm="tree").time_s for n in (4, 16, 64)]
    assert ring == sorted(ring) and tree == sorted(tree)
    # A ring's latency is linear in its ranks, a tree's logarithmic: 16x the nodes costs the ring far more.
    assert ring[2] / ring[0] > 4 and tree[2] / tree[0] < 2.5


def test_an_oversubscribed_tier_slows_only_the_traffic_that_crosses_it() -> None:
    base = load_cluster("dgx-a100")  # 20-node leaves
    tight = base.model_copy(update={"network": base.network.model_copy(update={"oversubscription": 2.0})})
    cfg = ParallelConfig(dp=64, zero=0, micro_batch=1)  # 8 nodes: inside one leaf
    inside = [estimate_step(MODEL, c, 64, 64, 8192, cfg).breakdown.dp_comm_s for c in (base, tight)]
    assert inside[0] == pytest.approx(inside[1])
    wide = replace(cfg, dp=512)  # 64 nodes: the gradients cross the spine
    across = [estimate_step(MODEL, c, 512, 512, 8192, wide).breakdown.dp_comm_s for c in (base, tight)]
    assert 1.3 < across[1] / across[0] <= 2.0
