"""The inventory as its consumers read it: the scheduler's node list and fabric's `local` cluster."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_scheduler_keeps_jobs_off_a_failing_gpu(probe_fixture) -> None:
    from gpuyard.scheduler.nodes import node_from_inventory

    def break_gpu5(desc: dict) -> None:
        desc["nvml"]["gpus"][5]["remapped_rows"] = {
            "corrected": 0,
            "uncorrected": 2,
            "pending": True,
            "failed": False,
        }

    node = node_from_inventory(probe_fixture("h100_hgx", break_gpu5).to_dict())
    assert node.gpus == 8 and set(node.excluded) == {5}
    assert set(node_from_inventory(probe_fixture("h100_hgx").to_dict()).excluded) == set()


def test_fabric_local_cluster_from_the_h100_inventory(probe_fixture) -> None:
    from gpuyard.fabric.local import cluster_from_inventory

    cluster = cluster_from_inventory(probe_fixture("h100_hgx").to_dict())
    assert cluster.gpus_per_node == 8 and cluster.accelerator.startswith("H100")
    assert cluster.nic.count == 8 and cluster.nic.gbps == 400.0 and cluster.nic.kind == "infiniband"
    assert cluster.intra.kind == "nvswitch"


def test_nic_level_transport_and_inactive_nvlinks(probe_fixture) -> None:
    doc = probe_fixture("l40s_pcie").to_dict()["node"]
    assert [(n["link_layer"], n["transport"]) for n in doc["nics"]] == [("Ethernet", "RoCE")] * 2

    def bridge_missing(desc: dict) -> None:
        desc["nvml"]["gpus"][0]["nvlink"] = {"version": 4, "peers": {}, "down": 12}

    gpu0 = probe_fixture("l40s_pcie", bridge_missing).to_dict()["node"]["accelerators"][0]
    assert gpu0["nvlink"] is None and gpu0["unavailable"]["nvlink"] == "12 links, none active"
