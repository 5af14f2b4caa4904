"""Step time of a workload on a concrete placement: NVLink domains, NIC share, spine and oversubscription."""

from __future__ import annotations

import pytest

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.models import PRESETS, ModelSpec
from gpuyard.fabric.placement_cost import (
    PlacementShape,
    Workload,
    effective_cluster,
    packed_shape,
    placement_cost,
)
from gpuyard.fabric.planner import Knobs
from gpuyard.fabric.presets import load_cluster

pytestmark = pytest.mark.unit

SMALL = ModelSpec("gpt-1.3b", 24, 2048, 16, 16, 8192, 51200, 2048, tied_embeddings=True)
FAST_KNOBS = Knobs(cp=1, micro_batch=1, virtual_stages=1, recompute="selective", zero=1)


def _cluster(oversubscription: float = 4.0, leaf_size: int = 8) -> Cluster:
    c = load_cluster("dgx-a100")
    net = c.network.model_copy(update={"oversubscription": oversubscription, "leaf_size": leaf_size})
    return c.model_copy(update={"network": net})


def _workload(model: ModelSpec, gpus: int, seq: int = 2048) -> Workload:
    return Workload(model, 4 * gpus, seq, FAST_KNOBS)


def _step(cluster: Cluster, workload: Workload, counts: tuple[int, ...], leaves: int) -> float:
    return placement_cost(cluster, workload, PlacementShape(counts, leaves, len(counts))).step_time_s


@pytest.mark.parametrize(
    ("model", "counts"),
    [
        (SMALL, (4, 4)),
        (SMALL, (8, 8)),
        (SMALL, (2, 2, 2, 2)),
        (PRESETS["llama3-8b"], (8, 8)),
        (PRESETS["llama3-8b"], (8, 8, 8, 8)),
        (PRESETS["llama3-8b"], (4, 4, 4, 4)),
        (PRESETS["llama3-70b"], (8,) * 8),
    ],
)
@pytest.mark.parametrize("oversubscription", [1.0, 2.0, 4.0])
def test_one_leaf_is_never_slower_than_the_same_gpus_over_two_leaves(
    model: ModelSpec, counts: tuple[int, ...], oversubscription: float
) -> None:
    cluster = _cluster(oversubscription)
    w = _workload(model, sum(counts), 4096 if model.name.startswith("llama") else 2048)
    inside = _step(cluster, w, counts, leaves=1)
    across = _step(cluster, w, counts, leaves=2)
    assert inside <= across
    if oversubscription >= 4:
        assert across > inside  # a 4:1 spine costs every multi-node data-parallel step something


def test_more_oversubscription_never_speeds_up_a_cross_leaf_placement() -> None:
    w = _workload(SMALL, 16)
    steps = [_step(_cluster(o), w, (8, 8), leaves=2) for o in (1.0, 2.0, 4.0, 8.0)]
    assert steps == sorted(steps) and steps[-1] > steps[0]


def test_a_job_inside_one_node_beats_the_same_gpus_split_over_nodes() -> None:
    cluster = _cluster()
    w = _workload(SMALL, 8)
    one = _step(cluster, w, (8,), leaves=1)
    assert one < _step(cluster, w, (4, 4), leaves=1) < _step(cluster, w, (2, 2, 2, 2), leaves=1)


def test_effective_cluster_shares_nics_by_gpu_and_sets_the_spine() -> None:
    cluster = _cluster()
    half = effective_cluster(cluster, PlacementShape((4, 4), leaves=2, nodes=2))
    assert half.domain == 4 and half.gpus_per_node == 4
    assert half.nic_GBps_per_node == pytest.approx(cluster.nic_GBps_per_node / 2)
    assert half.network.leaf_size == 1 and half.network.oversubscription == 4.0
    inside = effective_cluster(cluster, PlacementShape((8, 8), leaves=1, nodes=2))
    assert inside.network.leaf_size > 1000 and inside.nic_GBps_per_node == cluster.nic_GBps_per_node
    assert PlacementShape((8, 8, 4)).aligned == 4 and PlacementShape((5, 3)).aligned == 1


def test_packed_shape_is_whole_domains_under_one_leaf() -> None:
    cluster = _cluster()
    assert packed_shape(cluster, 4) == PlacementShape((4,), 1, 1)
    assert packed_shape(cluster, 20) == PlacementShape((8, 8, 4), 1, 3)
    nvl = load_cluster("gb200-nvl72")
    assert packed_shape(nvl, 16).domain_gpus == (16,) and packed_shape(nvl, 16).nodes == 4


def test_a_held_layout_is_costed_as_given_and_bad_ones_say_why() -> None:
    cluster = _cluster()
    knobs = Knobs(tp=2, pp=1, cp=1, micro_batch=1, virtual_stages=1, recompute="none", zero=1)
    knobs = Knobs(**{**vars(knobs), "sequence_parallel": False})
    cost = placement_cost(cluster, Workload(SMALL, 64, 2048, knobs), PlacementShape((8, 8), 1, 2))
    assert (cost.layout.tp, cost.layout.dp) == (2, 8)
    assert cost.to_dict()["layout"] == {"tp": 2, "pp": 1, "dp": 8, "cp": 1, "zero": 1}
    odd = Knobs(**{**vars(knobs), "tp": 3})
    with pytest.raises(ConfigError, match="not divisible"):
        placement_cost(cluster, Workload(SMALL, 64, 2048, odd), PlacementShape((8, 8), 1, 2))
    huge = Workload(PRESETS["llama3-405b"], 8, 8192, Knobs(cp=1, micro_batch=1, virtual_stages=1))
    with pytest.raises(CapacityError):
        placement_cost(cluster, huge, PlacementShape((8,), 1, 1))


def test_the_planner_adapts_the_layout_to_the_placement() -> None:
    # Tensor parallelism stays inside what each node holds of the job.
    cluster = _cluster()
    w = Workload(PRESETS["llama3-70b"], 256, 4096, FAST_KNOBS)
    packed = placement_cost(cluster, w, PlacementShape((8,) * 8, 1, 8))
    split = placement_cost(cluster, w, PlacementShape((2,) * 32, 1, 32))
    assert split.layout.tp <= 2 and packed.layout.tp <= 8
    assert split.step_time_s > packed.step_time_s
