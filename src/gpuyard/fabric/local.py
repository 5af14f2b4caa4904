"""The ``local`` cluster preset: one node built from this machine's hardware inventory.

A machine without accelerators becomes one node with one CPU "device" and loopback links, so every
fabric command still works (and the measured-collective bench can calibrate it).
"""

from __future__ import annotations

from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster, Device, IntraNode, Network, Nic
from gpuyard.hardware.catalog import AcceleratorSpec, match_spec

# FP32 FLOP per cycle per core: two FMA units x vector lanes x 2 (multiply + add).
_FLOPS_PER_CYCLE = {"avx512": 64, "avx2": 32}
# A nominal clock: the inventory does not report sustained all-core frequency.
_NOMINAL_GHZ = 2.5
# PCIe generation -> GB/s per direction of an x16 link.
_PCIE_X16_GBPS = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}


def _cpu_device(cpu: dict[str, Any]) -> Device:
    cores = int(cpu.get("cores") or 1)
    isa = {str(x).lower().replace("-", "").replace("_", "") for x in cpu.get("isa") or []}
    per_cycle = next((v for k, v in _FLOPS_PER_CYCLE.items() if any(i.startswith(k) for i in isa)), 16)
    tflops = cores * per_cycle * _NOMINAL_GHZ * 1e9 / 1e12
    memory = int(cpu.get("memory_bytes") or 1 << 30)
    return Device(
        name=f"cpu ({cpu.get('model') or 'unknown'})",
        memory_bytes=memory,
        memory_bw_GBps=20.0,
        bf16_tflops=tflops,
    )


def _nics(node: dict[str, Any]) -> Nic:
    nics = [n for n in node.get("nics") or [] if isinstance(n, dict)]
    rates = [float(n.get("rate_gbps") or n.get("rate") or 0) for n in nics]
    rates = [r for r in rates if r > 0]
    if not rates:
        return Nic(count=0, gbps=1.0, kind="loopback", gpudirect_rdma=False, latency_us=10.0)
    is_ib = any(str(n.get("link_layer", "")).lower() == "infiniband" for n in nics)
    return Nic(count=len(rates), gbps=min(rates), kind="infiniband" if is_ib else "roce", latency_us=5.0)


def _intra(spec: AcceleratorSpec, accelerators: list[dict[str, Any]]) -> IntraNode:
    has_nvlink = any(a.get("nvlink") for a in accelerators)
    if spec.nvlink_GBps and has_nvlink:
        switched = spec.interconnect_GBps >= 600 and len(accelerators) > 2
        return IntraNode(
            kind="nvswitch" if switched else "nvlink-bridge",
            nvlink_generation=spec.nvlink_generation,
            bw_GBps=spec.interconnect_unidir_GBps,
            latency_us=2.7,
        )
    pcie_gen = spec.pcie_gen or 4
    return IntraNode(
        kind="pcie", bw_GBps=_PCIE_X16_GBPS.get(pcie_gen, 32.0), latency_us=4.0, bw_efficiency=0.65
    )


def cluster_from_inventory(inventory: dict[str, Any]) -> Cluster:
    """Build a one-node cluster from ``probe_node().to_dict()``.

    Raises:
        ConfigError: the node has GPUs that the catalog does not know (write a cluster file instead).
    """
    node = inventory.get("node", inventory)
    accelerators = [a for a in node.get("accelerators") or [] if a.get("kind", "gpu") != "cpu"]
    hostname = node.get("hostname") or "localhost"
    if not accelerators:
        return Cluster(
            name="local",
            description=f"{hostname}: CPU only (one CPU device, loopback links)",
            accelerator="custom",
            device=_cpu_device(node.get("cpu") or {}),
            gpus_per_node=1,
            nodes=1,
            intra=IntraNode(kind="loopback", bw_GBps=10.0, latency_us=20.0),
            nic=_nics(node),
            network=Network(rail_optimized=False, leaf_size=1),
            sources=("gpuyard.hardware.probe (this machine); CPU TFLOP/s estimated from cores and ISA",),
        )
    name = str(accelerators[0].get("name", ""))
    spec = match_spec(name)
    if spec is None:
        raise ConfigError(
            f"local accelerator {name!r} is not in the catalog; describe it in a cluster file "
            "with a `device:` section and pass --cluster FILE"
        )
    return Cluster(
        name="local",
        description=f"{hostname}: {len(accelerators)}x {spec.name}",
        accelerator=spec.name,
        gpus_per_node=len(accelerators),
        nodes=1,
        intra=_intra(spec, accelerators),
        nic=_nics(node),
        sources=("gpuyard.hardware.probe (this machine)", *spec.sources),
    )


def _minimal_inventory() -> dict[str, Any]:
    """CPU-only inventory from the standard library and psutil, for when the prober is unavailable."""
    import os
    import platform
    import socket

    import psutil

    cpu = {
        "model": platform.processor() or platform.machine(),
        "cores": os.cpu_count() or 1,
        "memory_bytes": psutil.virtual_memory().total,
        "isa": [],
    }
    return {"node": {"hostname": socket.gethostname(), "cpu": cpu, "accelerators": [], "nics": []}}


def local_cluster() -> Cluster:
    """The cluster of this machine, from the hardware inventory (``gpuyard.hardware.probe``)."""
    try:
        # Imported here: probing touches NVML and sysfs, which only `local` needs.
        from gpuyard.hardware.probe import probe_node
    except ImportError:
        return cluster_from_inventory(_minimal_inventory())
    return cluster_from_inventory(probe_node().to_dict())
