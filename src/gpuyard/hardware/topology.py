"""The GPU/NIC connectivity matrix in the vocabulary of ``nvidia-smi topo -m``.

Legend (as nvidia-smi prints it):

* ``X``    the device itself
* ``NV#``  a bonded set of # NVLinks (direct, or through the NVSwitch fabric both GPUs attach to)
* ``PIX``  at most a single PCIe bridge (switch) between the two
* ``PXB``  multiple PCIe bridges, without crossing the host bridge
* ``PHB``  through a PCIe host bridge (the CPU root complex)
* ``NODE`` between PCIe host bridges within one NUMA node
* ``SYS``  across the SMP interconnect between NUMA nodes (QPI/UPI, Infinity Fabric)

The PCIe relations come from each device's sysfs path (host bridge -> ports -> device) and NUMA
node, the NV# counts from the NVLink peers NVML reports; nothing is asked of ``nvidia-smi``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuyard.hardware.inventory import NvLinkInfo, Topology, cpu_list

LEVELS = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass(frozen=True)
class Endpoint:
    """A device placed in the matrix.

    Attributes:
        label: ``GPU<n>`` or ``NIC<n>``.
        bus_id: PCI address in sysfs form (``0000:18:00.0``), or None.
        chain: PCI path from the host bridge down to the device (:func:`~gpuyard.hardware.sysfs.pci_chain`).
        numa: NUMA node, or None when the kernel does not say (single-node machines print -1).
        cpus: CPUs close to the device (the ``CPU Affinity`` column), empty when unknown.
        nvlink: the GPU's NVLinks, None for NICs and GPUs without NVLink.
    """

    label: str
    bus_id: str | None
    chain: tuple[str, ...] | None
    numa: int | None
    cpus: tuple[int, ...] = ()
    nvlink: NvLinkInfo | None = None


def pcie_relation(a: Endpoint, b: Endpoint) -> str:
    """The PCIe/SMP relation between two distinct devices: PIX, PXB, PHB, NODE or SYS."""
    if a.numa is not None and b.numa is not None and a.numa != b.numa:
        return "SYS"
    if a.chain is None or b.chain is None:
        # Without a PCI path only the NUMA node is known: the farthest relation within a node.
        return "NODE"
    if a.chain[0] != b.chain[0]:
        return "NODE"
    below_a, below_b = a.chain[1:], b.chain[1:]
    shared = 0
    for x, y in zip(below_a, below_b, strict=False):
        if x != y:
            break
        shared += 1
    if shared == 0:
        return "PHB"  # the paths meet only at the root complex
    # Below the shared bridge, one switch costs two hops (its downstream port, then the device):
    # two hops is a single bridge, more means bridges chained under one another.
    hops = max(len(below_a) - shared, len(below_b) - shared)
    return "PIX" if hops <= 2 else "PXB"


def nvlink_count(a: Endpoint, b: Endpoint) -> int:
    """NVLinks joining two GPUs: direct GPU-to-GPU links plus links through a shared NVSwitch fabric."""
    if a.nvlink is None or b.nvlink is None:
        return 0
    direct = sum(p.links for p in a.nvlink.peers if p.kind == "gpu" and p.bus_id == b.bus_id)
    a_sw = [p for p in a.nvlink.peers if p.kind == "switch"]
    b_sw = [p for p in b.nvlink.peers if p.kind == "switch"]
    switched = 0
    if a_sw and b_sw:
        # HGX boards wire every GPU to every NVSwitch, so two GPUs meet at the links of the weaker
        # one; nvidia-smi prints the same figure (NV18 on H100 HGX, NV12 on A100 HGX).
        switched = min(sum(p.links for p in a_sw), sum(p.links for p in b_sw))
    return direct + switched


def relation(a: Endpoint, b: Endpoint, known: Mapping[frozenset[str], str] | None = None) -> str:
    """The ``nvidia-smi topo -m`` entry between two endpoints.

    Args:
        a: one endpoint.
        b: the other.
        known: PCIe relations already known per pair of labels (NVML's answer when sysfs has no
            path for a GPU); used only when a path is missing.
    """
    if a.label == b.label:
        return "X"
    links = nvlink_count(a, b)
    if links:
        return f"NV{links}"
    if (a.chain is None or b.chain is None) and known:
        pair = known.get(frozenset((a.label, b.label)))
        if pair is not None:
            return pair
    return pcie_relation(a, b)


def build_topology(
    gpus: Sequence[Endpoint],
    nics: Sequence[Endpoint],
    nic_names: Sequence[str] = (),
    known: Mapping[frozenset[str], str] | None = None,
) -> Topology:
    """The full matrix, GPUs first then NICs, as nvidia-smi orders it.

    Args:
        gpus: GPU endpoints, labelled ``GPU<n>``.
        nics: NIC endpoints, labelled ``NIC<n>``.
        nic_names: device names for the NIC legend (``mlx5_0``), in the order of ``nics``.
        known: PCIe relations per label pair to use where a PCI path is missing (see :func:`relation`).
    """
    devices = [*gpus, *nics]
    matrix = tuple(tuple(relation(a, b, known) for b in devices) for a in devices)
    return Topology(
        devices=tuple(d.label for d in devices),
        matrix=matrix,
        cpu_affinity={g.label: cpu_list(g.cpus) if g.cpus else "N/A" for g in gpus},
        numa_affinity={g.label: g.numa for g in gpus},
        nic_legend={n.label: name for n, name in zip(nics, nic_names, strict=False)},
    )


_CELL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")


def parse_topo_matrix(text: str) -> tuple[list[str], list[list[str]]]:
    """Read the matrix part of a recorded ``nvidia-smi topo -m`` output.

    Returns:
        ``(devices, matrix)``: the row labels (``GPU0``..., ``NIC0``...) and, per row, the entries
        against every device column; the affinity columns and the legend are dropped.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next(ln for ln in lines if ln.split() and ln.split()[0].startswith("GPU"))
    columns = [c for c in header.split() if re.match(r"^(GPU|NIC)\d+$", c)]
    devices: list[str] = []
    matrix: list[list[str]] = []
    for ln in lines[lines.index(header) + 1 :]:
        cells = ln.split()
        if not cells or not re.match(r"^(GPU|NIC)\d+$", cells[0]):
            if devices:
                break
            continue
        entries = [c for c in cells[1 : 1 + len(columns)] if _CELL.match(c)]
        devices.append(cells[0])
        matrix.append(entries)
    return devices, matrix
