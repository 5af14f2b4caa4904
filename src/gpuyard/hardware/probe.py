"""Probe this node: CPU, accelerators, NICs and the topology between them, as one :class:`NodeInventory`.

``probe_node()`` is what the CLI (``gpuyard hw``), fabric's ``local`` preset and the scheduler call.
Nothing here raises on missing hardware: no NVML library, no driver, no GPU, no RDMA stack all give
a clean, smaller inventory.
"""

from __future__ import annotations

import dataclasses
import socket
from datetime import datetime, timezone

from gpuyard.hardware.cpu import probe_cpu
from gpuyard.hardware.frameworks import framework_accelerators
from gpuyard.hardware.health import HealthThresholds
from gpuyard.hardware.inventory import Accelerator, Nic, NodeInventory, Topology
from gpuyard.hardware.nics import list_nics
from gpuyard.hardware.nvidia import probe_nvidia
from gpuyard.hardware.nvml import NvmlBackend, NvmlCallError, close_nvml, open_nvml
from gpuyard.hardware.sysfs import HostRoots, pci_chain, pci_device_dir
from gpuyard.hardware.topology import Endpoint, build_topology


def _endpoints(
    gpus: list[Accelerator], nics: tuple[Nic, ...], roots: HostRoots
) -> tuple[list[Endpoint], list[Endpoint]]:
    def chain(bus_id: str | None) -> tuple[str, ...] | None:
        return pci_chain(pci_device_dir(bus_id, roots.sys), roots.sys) if bus_id else None

    g_ends = [
        Endpoint(f"GPU{g.index}", g.bus_id, chain(g.bus_id), g.numa, g.cpu_affinity, g.nvlink)
        for g in gpus
        if g.kind in ("cuda", "rocm")
    ]
    n_ends = [Endpoint(f"NIC{k}", n.bus_id, chain(n.bus_id), n.numa) for k, n in enumerate(nics)]
    return g_ends, n_ends


def _nvml_relations(
    nvml: NvmlBackend, g_ends: list[Endpoint], gpus: list[Accelerator]
) -> dict[frozenset[str], str]:
    # Without a sysfs path (a container hiding /sys/devices) ask NVML, as nvidia-smi does, which PCIe
    # level two GPUs share. NICs have no NVML handle, so they keep the NUMA-based fallback.
    nvml_index = {f"GPU{g.index}": g.index for g in gpus if g.source == "nvml"}
    known: dict[frozenset[str], str] = {}
    for k, a in enumerate(g_ends):
        for b in g_ends[k + 1 :]:
            has_paths = a.chain is not None and b.chain is not None
            if has_paths or a.label not in nvml_index or b.label not in nvml_index:
                continue
            try:
                level = nvml.common_ancestor(nvml_index[a.label], nvml_index[b.label])
            except NvmlCallError:
                continue
            known[frozenset((a.label, b.label))] = level
    return known


def probe_node(
    nvml: NvmlBackend | None = None,
    *,
    roots: HostRoots | None = None,
    frameworks: bool | None = None,
    thresholds: HealthThresholds | None = None,
    hostname: str | None = None,
) -> NodeInventory:
    """Inventory this machine.

    Args:
        nvml: an NVML backend to use (tests pass :class:`gpuyard.hardware.fake.FakeNvml`); None opens
            the real NVML, and a machine without it is simply GPU-less.
        roots: where /proc, /sys and /dev are (a recorded tree in tests).
        frameworks: ask torch / JAX for accelerators: None (default) only when NVML found no GPU and a
            cheap sign says they could find one; True always; False never.
        thresholds: health limits (see :mod:`gpuyard.hardware.health`).
        hostname: name to record (default: this machine's).

    Returns:
        The :class:`NodeInventory`; ``to_dict()`` is the ``gpuyard hw --json`` document.
    """
    roots = roots or HostRoots()
    cpu = probe_cpu(roots)
    nics = list_nics(roots)
    owned = nvml is None
    reason = None
    if owned:
        nvml, reason = open_nvml()
    try:
        if nvml is not None:
            gpus, driver = probe_nvidia(nvml, roots, cpu, thresholds)
        else:
            gpus = []
            driver = {"nvml": False, "driver_version": None, "cuda_driver_version": None, "error": reason}
        driver["frameworks"] = []
        if frameworks or (frameworks is None and not gpus):
            others, looked = framework_accelerators(roots, force=bool(frameworks))
            gpus = [*gpus, *[_renumber(a, len(gpus) + k) for k, a in enumerate(others)]]
            driver["frameworks"] = looked
        g_ends, n_ends = _endpoints(gpus, nics, roots)
        known = _nvml_relations(nvml, g_ends, gpus) if nvml is not None else {}
    finally:
        if owned:
            close_nvml(nvml)
    topology: Topology = build_topology(g_ends, n_ends, [n.name for n in nics], known)
    return NodeInventory(
        hostname=hostname or socket.gethostname(),
        cpu=cpu,
        accelerators=tuple(gpus),
        topology=topology,
        nics=nics,
        driver=driver,
        probed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _renumber(a: Accelerator, index: int) -> Accelerator:
    return a if a.index == index else dataclasses.replace(a, index=index)
