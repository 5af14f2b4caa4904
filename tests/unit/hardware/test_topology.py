"""The topology matrix: the recorded H100 and L40S nodes give their public nvidia-smi topo -m matrices."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.hardware.inventory import NvLinkInfo, NvLinkPeer
from gpuyard.hardware.topology import Endpoint, build_topology, parse_topo_matrix, pcie_relation, relation

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["h100_hgx", "l40s_pcie"])
def test_fixture_gives_the_public_matrix(name: str, probe_fixture, fixtures_dir: Path) -> None:
    inv = probe_fixture(name)
    devices, matrix = parse_topo_matrix((fixtures_dir / f"{name}.topo.txt").read_text())
    assert list(inv.topology.devices) == devices
    assert [list(row) for row in inv.topology.matrix] == matrix


def test_h100_is_nv18_between_every_gpu_pair_and_pix_to_its_own_nic(probe_fixture) -> None:
    topo = probe_fixture("h100_hgx").topology
    gpus = [d for d in topo.devices if d.startswith("GPU")]
    nics = [d for d in topo.devices if d.startswith("NIC")]
    assert len(gpus) == 8 and len(nics) == 8
    assert all(topo.link(a, b) == "NV18" for a in gpus for b in gpus if a != b)
    # Each GPU shares a PCIe switch with exactly one NDR NIC (the rail NCCL uses for it).
    for g in gpus:
        assert [topo.link(g, n) for n in nics].count("PIX") == 1
    assert topo.cpu_affinity["GPU0"] == "0-79" and topo.numa_affinity["GPU7"] == 1
    assert topo.nic_legend["NIC0"] == "mlx5_0"


def test_l40s_has_no_nvlink_only_pcie_relations(probe_fixture) -> None:
    topo = probe_fixture("l40s_pcie").topology
    cells = {c for row in topo.matrix for c in row}
    assert cells == {"X", "PIX", "NODE", "SYS"}
    assert topo.link("GPU0", "GPU1") == "NODE" and topo.link("GPU1", "GPU2") == "SYS"
    assert topo.link("NIC0", "NIC1") == "PIX"


def test_losing_nvlinks_changes_the_matrix(probe_fixture) -> None:
    # The matrix is derived, not copied: GPU3 with only its first two NVSwitches (9 links) shows NV9.
    def drop_links(desc: dict) -> None:
        desc["nvml"]["gpus"][3]["nvlink"] = {
            "version": 6,
            "remote_kind": "switch",
            "peers": {"00000000:05:00.0": 4, "00000000:06:00.0": 5},
        }

    topo = probe_fixture("h100_hgx", drop_links).topology
    assert topo.link("GPU3", "GPU0") == "NV9" and topo.link("GPU0", "GPU3") == "NV9"
    assert topo.link("GPU0", "GPU1") == "NV18"


def _ep(label: str, chain: str | None, numa: int | None = 0, nvlink: NvLinkInfo | None = None) -> Endpoint:
    bus = chain.split("/")[-1] if chain else None
    return Endpoint(label, bus, tuple(chain.split("/")) if chain else None, numa, nvlink=nvlink)


@pytest.mark.parametrize(
    ("a", "b", "numa_b", "expected"),
    [
        # same switch: both hang off downstream ports of one switch
        (
            "pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0",
            "pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0",
            0,
            "PIX",
        ),
        # two functions of one dual-port card
        ("pci0000:a0/0000:a0:03.1/0000:a1:00.0", "pci0000:a0/0000:a0:03.1/0000:a1:00.1", 0, "PIX"),
        # switches chained under a common switch
        (
            "pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0",
            "pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1b:00.0",
            0,
            "PXB",
        ),
        # two root ports of one host bridge
        ("pci0000:00/0000:00:01.1/0000:01:00.0", "pci0000:00/0000:00:03.1/0000:03:00.0", 0, "PHB"),
        # two host bridges, one NUMA node
        ("pci0000:00/0000:00:01.1/0000:01:00.0", "pci0000:40/0000:40:01.1/0000:41:00.0", 0, "NODE"),
        # two NUMA nodes
        ("pci0000:00/0000:00:01.1/0000:01:00.0", "pci0000:80/0000:80:01.1/0000:81:00.0", 1, "SYS"),
    ],
)
def test_pcie_relations(a: str, b: str, numa_b: int, expected: str) -> None:
    ea, eb = _ep("GPU0", a), _ep("GPU1", b, numa_b)
    assert pcie_relation(ea, eb) == expected
    assert pcie_relation(eb, ea) == expected


def test_unknown_pci_path_falls_back_to_numa() -> None:
    assert pcie_relation(_ep("GPU0", None, 0), _ep("NIC0", None, 0)) == "NODE"
    assert pcie_relation(_ep("GPU0", None, 0), _ep("NIC0", None, 1)) == "SYS"


def test_direct_gpu_links_count_per_peer() -> None:
    # A 4-GPU board wired GPU-to-GPU (no NVSwitch): 4 links to each neighbour, none to the far one.
    chains = {i: f"pci0000:00/0000:00:0{i}.0/0000:0{i}:00.0" for i in range(3)}
    bus = {i: chains[i].split("/")[-1] for i in range(3)}
    nv0 = NvLinkInfo("3.0", 4, 0, (NvLinkPeer(bus[1], "gpu", 4),))
    nv1 = NvLinkInfo("3.0", 4, 0, (NvLinkPeer(bus[0], "gpu", 4),))
    g0, g1 = _ep("GPU0", chains[0], nvlink=nv0), _ep("GPU1", chains[1], nvlink=nv1)
    g2 = _ep("GPU2", chains[2], nvlink=NvLinkInfo("3.0", 0, 4, ()))
    topo = build_topology([g0, g1, g2], [])
    assert topo.link("GPU0", "GPU1") == "NV4"
    assert topo.link("GPU0", "GPU2") == "PHB"
    assert relation(g0, g0) == "X"


def test_parse_topo_matrix_reads_public_layout() -> None:
    text = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV4\tPHB\t0-7\t0\n"
        "GPU1\tNV4\t X \tSYS\t8-15\t1\n"
        "NIC0\tPHB\tSYS\t X \n\nLegend:\n\n  X    = Self\n"
    )
    devices, matrix = parse_topo_matrix(text)
    assert devices == ["GPU0", "GPU1", "NIC0"]
    assert matrix == [["X", "NV4", "PHB"], ["NV4", "X", "SYS"], ["PHB", "SYS", "X"]]


def test_without_sysfs_paths_nvml_common_ancestor_is_used(probe_fixture) -> None:
    # A container that hides /sys/devices: GPU-GPU relations come from NVML, as in nvidia-smi.
    def hide_gpu_paths(desc: dict) -> None:
        pci = desc["host"]["pci"]
        for gpu in desc["nvml"]["gpus"]:
            pci.pop(gpu["bus_id"][4:].lower())
        desc["nvml"]["topology"] = {"0,1": "PXB", "2,3": "NODE"}

    topo = probe_fixture("l40s_pcie", hide_gpu_paths).topology
    assert topo.link("GPU0", "GPU1") == "PXB" and topo.link("GPU2", "GPU3") == "NODE"
    # No NVML answer for this pair: NUMA nodes still tell SYS; same node without a path says NODE.
    assert topo.link("GPU1", "GPU2") == "SYS"
    assert topo.link("GPU2", "NIC0") == "NODE" and topo.link("NIC0", "NIC1") == "PIX"
