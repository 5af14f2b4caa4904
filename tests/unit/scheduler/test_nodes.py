"""Where nodes come from: the hardware inventory (health-excluded GPUs, fake GPUs) and fabric presets."""

from __future__ import annotations

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric.presets import load_cluster
from gpuyard.scheduler.nodes import (
    FAKE_GPU_TYPE,
    check_fabric_nodes,
    node_from_inventory,
    nodes_from_fabric,
)
from gpuyard.scheduler.placement import ClusterState, place

pytestmark = pytest.mark.unit


def _inventory(healths: list[str]) -> dict[str, object]:
    return {
        "node": {
            "hostname": "h1",
            "cpu": {"cores": 16},
            "accelerators": [{"index": i, "name": "H100", "health": h} for i, h in enumerate(healths)],
        }
    }


def test_failing_gpus_are_excluded_from_placement() -> None:
    node = node_from_inventory(_inventory(["pass", "fail", "warn", "pass"]))
    assert node.gpus == 4 and node.excluded == frozenset({1}) and node.gpu_type == "H100" and node.cpus == 16
    state = ClusterState([node])
    assert state.total_gpus == 3
    assert place(state, 4) is None and place(state, 3) is not None


def test_gpu_less_machine_and_fake_gpus() -> None:
    bare = node_from_inventory({"node": {"hostname": "vm", "cpu": {"cores": 2}, "accelerators": []}})
    assert bare.gpus == 0 and bare.cpus == 2
    fake = node_from_inventory(
        {"node": {"hostname": "vm", "cpu": {"cores": 2}, "accelerators": []}}, fake_gpus=4
    )
    assert fake.gpus == 4 and fake.gpu_type == FAKE_GPU_TYPE
    with pytest.raises(ConfigError):
        node_from_inventory({"node": {}}, fake_gpus=-1)


def test_fabric_presets_give_nvlink_domains_and_leaves() -> None:
    from gpuyard.fabric.presets import load_cluster

    nvl = nodes_from_fabric(load_cluster("gb200-nvl72"), nodes=36)
    assert len(nvl) == 36 and nvl[0].gpus == 4
    assert len({n.nvlink_domain for n in nvl}) == 2  # 72 GPUs per domain = 18 nodes of 4
    state = ClusterState(nvl)
    p = place(state, 64)
    assert p is not None and len({state.domain[i] for i, _ in p.nodes}) == 1
    dgx = nodes_from_fabric(load_cluster("dgx-a100"), nodes=4)
    assert {n.nvlink_domain for n in dgx} == {"nvl0", "nvl1", "nvl2", "nvl3"}
    with pytest.raises(ConfigError, match="--nodes"):
        nodes_from_fabric(load_cluster("dgx-a100"))


def test_a_fabric_cluster_must_describe_the_schedulers_nodes() -> None:
    dgx, nvl72 = load_cluster("dgx-a100"), load_cluster("gb200-nvl72")
    # Matching GPU counts pass, unhealthy GPUs included (they are still in the box); CPU-only nodes
    # (a Ray head) are not GPU nodes; the node count is not compared.
    check_fabric_nodes(dgx, [node_from_inventory(_inventory(["pass"] * 7 + ["fail"]))])
    check_fabric_nodes(dgx, [*nodes_from_fabric(dgx, 3), node_from_inventory(_inventory([]))])
    with pytest.raises(ConfigError, match=r"8 GPUs per node, but node 'h1' has 4: .*give --gpus 8"):
        check_fabric_nodes(dgx, [node_from_inventory({"hostname": "h1"}, fake_gpus=4)])
    with pytest.raises(ConfigError, match=r"node 'h1' has 2: .*a cluster file with gpus_per_node: 2"):
        check_fabric_nodes(dgx, [node_from_inventory(_inventory(["pass", "pass"]))])
    with pytest.raises(ConfigError, match="no node here has GPUs"):
        check_fabric_nodes(dgx, [node_from_inventory(_inventory([]))])
    # A 72-GPU NVLink domain over 4-GPU nodes: fine on one node, refused over several (which share one?).
    check_fabric_nodes(nvl72, [node_from_inventory({"hostname": "h1"}, fake_gpus=4)])
    with pytest.raises(ConfigError, match="NVLink domains of 72 GPUs across nodes"):
        check_fabric_nodes(nvl72, [node_from_inventory({"hostname": f"h{i}"}, fake_gpus=4) for i in range(2)])
    split = dgx.model_copy(update={"intra": dgx.intra.model_copy(update={"domain_size": 4})})
    with pytest.raises(ConfigError, match="splits a node into NVLink domains of 4 GPUs"):
        check_fabric_nodes(split, nodes_from_fabric(dgx, 1))
