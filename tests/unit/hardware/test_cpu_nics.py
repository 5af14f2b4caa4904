"""CPU/NUMA/ISA and RDMA NIC discovery from /proc and /sys trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuyard.hardware.cpu import numa_of_cpus, probe_cpu
from gpuyard.hardware.inventory import cpu_list, parse_cpu_list
from gpuyard.hardware.nics import list_nics, parse_rate_gbps
from gpuyard.hardware.sysfs import HostRoots

pytestmark = pytest.mark.unit

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve sve2 svebf16 i8mm bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd4f

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve sve2 svebf16 i8mm bf16
CPU implementer\t: 0x41
CPU part\t: 0xd4f
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_this_machine() -> None:
    cpu = probe_cpu()
    assert cpu.threads >= cpu.cores >= 1 and cpu.sockets >= 1
    assert cpu.usable_cpus == len(os.sched_getaffinity(0))
    assert cpu.memory_bytes > 0 and cpu.numa_nodes
    flags = Path("/proc/cpuinfo").read_text()
    assert ("avx2" in cpu.isa) == (" avx2" in flags)


def test_arm_cpu_features_and_sysfs_topology(tmp_path: Path) -> None:
    _write(tmp_path / "proc" / "cpuinfo", ARM_CPUINFO)
    _write(tmp_path / "proc" / "meminfo", "MemTotal:       1048576 kB\n")
    for n in range(2):
        topo = tmp_path / "sys" / "devices" / "system" / "cpu" / f"cpu{n}" / "topology"
        _write(topo / "physical_package_id", "0")
        _write(topo / "core_id", str(n))
    cpu = probe_cpu(HostRoots.under(tmp_path))
    assert cpu.arch == "aarch64" and "implementer 0x41" in cpu.model
    assert (cpu.cores, cpu.threads, cpu.sockets) == (2, 2, 1)
    assert {"sve", "sve2", "bf16", "i8mm", "asimddp"} <= set(cpu.isa)
    summary = cpu.isa_summary()
    assert summary["sve"] and summary["bf16"] and summary["vnni"] and not summary["avx512"]
    assert cpu.memory_bytes == 2**30
    # No NUMA directory: one node holding every CPU.
    assert [(n.id, n.cpus) for n in cpu.numa_nodes] == [(0, (0, 1))]


def test_missing_proc_is_not_a_crash(tmp_path: Path) -> None:
    cpu = probe_cpu(HostRoots.under(tmp_path))
    assert cpu.threads >= 1 and cpu.isa == () and cpu.memory_bytes == 0


@given(st.sets(st.integers(min_value=0, max_value=600), max_size=80))
def test_cpu_list_roundtrip(cpus: set[int]) -> None:
    text = cpu_list(sorted(cpus))
    assert parse_cpu_list(text) == sorted(cpus)
    assert "--" not in text


def test_numa_of_cpus() -> None:
    from gpuyard.hardware.inventory import NumaNode

    nodes = (NumaNode(0, tuple(range(8)), None), NumaNode(1, tuple(range(8, 16)), None))
    assert numa_of_cpus([9, 10], nodes) == 1
    assert numa_of_cpus([99], nodes) is None


def test_h100_nics(probe_fixture) -> None:
    nics = probe_fixture("h100_hgx").nics
    assert [n.name for n in nics] == [f"mlx5_{i}" for i in range(8)]
    assert all(n.ports[0].rate_gbps == 400.0 and n.hca_type == "MT4129" for n in nics)
    assert [n.numa for n in nics] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert nics[7].bus_id == "0000:19:00.0" and nics[7].netdevs == ("ibp25s0",)


def test_port_down_counts_no_bandwidth(description, probe_description) -> None:
    desc = description("l40s_pcie")
    desc["infiniband"]["mlx5_1"]["ports"]["1"].update(state="1: DOWN", phys_state="3: Disabled")
    doc = probe_description(desc).to_dict()["node"]["nics"]
    assert [n["rate_gbps"] for n in doc] == [100.0, 0.0]
    assert doc[1]["ports"][0]["state"] == "1: DOWN"


def test_no_rdma_stack(tmp_path: Path) -> None:
    assert list_nics(HostRoots.under(tmp_path)) == ()


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("", None),
    ],
)
def test_parse_rate(text: str, gbps: float | None) -> None:
    assert parse_rate_gbps(text) == gbps
