"""Where nodes come from: the hardware inventory (health-excluded GPUs, fake GPUs) and fabric presets."""

from __future__ import annotations

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.nodes import FAKE_GPU_TYPE, node_from_inventory, nodes_from_fabric
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
    from gpuyard.fabric.cluster import load_cluster

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
