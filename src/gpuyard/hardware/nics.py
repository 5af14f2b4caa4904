"""RDMA NICs (InfiniBand HCAs and RoCE NICs) from /sys/class/infiniband."""

from __future__ import annotations

import re
from pathlib import Path

from gpuyard.hardware.inventory import Nic, NicPort
from gpuyard.hardware.sysfs import HostRoots, read_int, read_text

_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def parse_rate_gbps(text: str) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0; None when the kernel prints something else."""
    m = _RATE.search(text)
    return float(m.group(1)) if m else None


def _port(d: Path) -> NicPort:
    rate = read_text(d / "rate") or ""
    return NicPort(
        port=int(d.name),
        state=read_text(d / "state") or "unknown",
        phys_state=read_text(d / "phys_state") or "unknown",
        rate_gbps=parse_rate_gbps(rate),
        rate=rate,
        link_layer=read_text(d / "link_layer") or "unknown",
    )


def list_nics(roots: HostRoots | None = None) -> tuple[Nic, ...]:
    """Every RDMA device the kernel registered, in name order.

    Args:
        roots: where /sys is (tests use a recorded tree).

    Returns:
        One :class:`Nic` per ``/sys/class/infiniband/<dev>``; an empty tuple when the class does not
        exist (no RDMA stack loaded), never an exception.
    """
    roots = roots or HostRoots()
    base = roots.sys / "class" / "infiniband"
    if not base.is_dir():
        return ()
    nics = []
    for dev in sorted(base.iterdir(), key=lambda p: p.name):
        ports_dir = dev / "ports"
        ports = []
        if ports_dir.is_dir():
            ports = [_port(p) for p in sorted(ports_dir.iterdir(), key=lambda p: p.name) if p.name.isdigit()]
        device = dev / "device"
        bus_id = device.resolve().name if device.exists() else None
        numa = read_int(device / "numa_node")
        net_dir = device / "net"
        netdevs = tuple(sorted(p.name for p in net_dir.iterdir())) if net_dir.is_dir() else ()
        nics.append(
            Nic(
                name=dev.name,
                bus_id=bus_id,
                numa=numa if numa is not None and numa >= 0 else None,
                ports=tuple(ports),
                netdevs=netdevs,
                hca_type=read_text(dev / "hca_type"),
                fw_ver=read_text(dev / "fw_ver"),
            )
        )
    return tuple(nics)
