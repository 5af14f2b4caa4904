"""A node's inventory as frozen dataclasses; ``to_dict()`` gives the ``gpuyard hw --json`` document."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEALTH_ORDER = {"pass": 0, "warn": 1, "fail": 2}


def cpu_list(cpus: list[int] | tuple[int, ...]) -> str:
    """Compress CPU ids to the kernel's list syntax: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str) -> list[int]:
    """Expand the kernel's list syntax (``"0-2,5"``) to CPU ids; empty text gives ``[]``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its CPUs and local memory."""

    id: int
    cpus: tuple[int, ...]
    memory_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "cpus": cpu_list(self.cpus), "memory_bytes": self.memory_bytes}


@dataclass(frozen=True)
class CpuInfo:
    """The host CPUs and memory.

    Attributes:
        model: marketing name from /proc/cpuinfo (or the architecture when the kernel gives none).
        vendor: ``GenuineIntel``, ``AuthenticAMD``, an ARM implementer code, ...
        arch: machine architecture (``x86_64``, ``aarch64``).
        sockets: physical packages.
        cores: physical cores (hyper-threads not counted).
        threads: logical CPUs the kernel knows.
        usable_cpus: logical CPUs this process may run on (sched_getaffinity: cgroups, taskset).
        memory_bytes: total RAM.
        isa: AI-relevant instruction-set extensions present (avx2, avx512_bf16, amx_tile, sve, ...).
        numa_nodes: NUMA nodes with their CPUs and memory.
    """

    model: str
    vendor: str
    arch: str
    sockets: int
    cores: int
    threads: int
    usable_cpus: int
    memory_bytes: int
    isa: tuple[str, ...]
    numa_nodes: tuple[NumaNode, ...]

    def isa_summary(self) -> dict[str, bool]:
        """Families a kernel library may pick from: AVX-512, VNNI (int8 dot), BF16, AMX, SVE."""
        have = set(self.isa)
        return {
            "avx2": "avx2" in have,
            "avx512": "avx512f" in have,
            "vnni": bool(have & {"avx512_vnni", "avx_vnni", "asimddp"}),
            "bf16": bool(have & {"avx512_bf16", "amx_bf16", "bf16", "svebf16"}),
            "fp16": bool(have & {"avx512_fp16", "amx_fp16", "fphp"}),
            "amx": "amx_tile" in have,
            "sve": "sve" in have,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "vendor": self.vendor,
            "arch": self.arch,
            "sockets": self.sockets,
            "cores": self.cores,
            "threads": self.threads,
            "usable_cpus": self.usable_cpus,
            "memory_bytes": self.memory_bytes,
            "isa": list(self.isa),
            "isa_summary": self.isa_summary(),
            "numa_nodes": [n.to_dict() for n in self.numa_nodes],
        }


@dataclass(frozen=True)
class HealthReason:
    """Why a device is not ``pass``: a level (warn/fail), a stable code, and a sentence."""

    level: str
    code: str
    message: str


@dataclass(frozen=True)
class Health:
    """pass / warn / fail, and the reasons behind anything but pass."""

    status: str
    reasons: tuple[HealthReason, ...] = ()

    def reasons_dicts(self) -> list[dict[str, str]]:
        """The reasons as plain JSON objects (``level``, ``code``, ``message``)."""
        return [{"level": r.level, "code": r.code, "message": r.message} for r in self.reasons]


@dataclass(frozen=True)
class NvLinkPeer:
    """What a GPU's NVLinks reach: one remote device and how many links go to it."""

    bus_id: str
    kind: str
    links: int
    gpu_index: int | None = None


@dataclass(frozen=True)
class NvLinkInfo:
    """The NVLinks of one GPU; ``version`` is NVLink's own numbering (``"4.0"`` on H100)."""

    version: str | None
    active_links: int
    inactive_links: int
    peers: tuple[NvLinkPeer, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "generation": int(self.version.split(".")[0]) if self.version else None,
            "active_links": self.active_links,
            "inactive_links": self.inactive_links,
            "peers": [
                {"bus_id": p.bus_id, "kind": p.kind, "links": p.links, "gpu_index": p.gpu_index}
                for p in self.peers
            ],
        }


@dataclass(frozen=True)
class Accelerator:
    """One accelerator (NVIDIA or AMD GPU, Apple MPS, TPU chip).

    ``kind`` is ``cuda`` (NVIDIA via NVML), ``rocm``, ``mps`` or ``tpu``; fields a source cannot give
    are None, and ``unavailable`` maps each such field to why (e.g. ``not supported on this GPU``).
    ``telemetry`` holds the moment's readings (power, temperature, utilization, ECC, throttling).
    """

    index: int
    kind: str
    vendor: str
    name: str
    uuid: str | None
    memory_bytes: int | None
    compute_capability: str | None
    bus_id: str | None = None
    numa: int | None = None
    cpu_affinity: tuple[int, ...] = ()
    pcie: dict[str, int] | None = None
    nvlink: NvLinkInfo | None = None
    mig: dict[str, bool] | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    health: Health = Health("pass")
    spec: dict[str, Any] | None = None
    source: str = "nvml"
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "vendor": self.vendor,
            "name": self.name,
            "uuid": self.uuid,
            "memory_bytes": self.memory_bytes,
            "compute_capability": self.compute_capability,
            "bus_id": self.bus_id,
            "numa": self.numa,
            "cpu_affinity": cpu_list(self.cpu_affinity) if self.cpu_affinity else None,
            "pcie": self.pcie,
            "nvlink": self.nvlink.to_dict() if self.nvlink else None,
            "mig": self.mig,
            **self.telemetry,
            # A plain string so consumers can test `== "fail"`; the why is beside it.
            "health": self.health.status,
            "health_reasons": self.health.reasons_dicts(),
            "spec": self.spec,
            "source": self.source,
            "unavailable": dict(self.unavailable),
        }


@dataclass(frozen=True)
class NicPort:
    """One port of an RDMA device (from /sys/class/infiniband/<dev>/ports/<n>)."""

    port: int
    state: str
    phys_state: str
    rate_gbps: float | None
    rate: str
    link_layer: str

    @property
    def transport(self) -> str:
        """``InfiniBand``, or ``RoCE`` when the RDMA port runs over Ethernet."""
        return "RoCE" if self.link_layer.lower() == "ethernet" else self.link_layer


@dataclass(frozen=True)
class Nic:
    """An RDMA-capable NIC (InfiniBand HCA or RoCE NIC)."""

    name: str
    bus_id: str | None
    numa: int | None
    ports: tuple[NicPort, ...]
    netdevs: tuple[str, ...] = ()
    hca_type: str | None = None
    fw_ver: str | None = None

    def to_dict(self) -> dict[str, Any]:
        active = [p for p in self.ports if p.state.upper().endswith("ACTIVE")]
        best = max(active, key=lambda p: p.rate_gbps or 0.0, default=self.ports[0] if self.ports else None)
        return {
            "name": self.name,
            "bus_id": self.bus_id,
            "numa": self.numa,
            "netdevs": list(self.netdevs),
            "hca_type": self.hca_type,
            "fw_ver": self.fw_ver,
            "rate_gbps": max((p.rate_gbps or 0.0 for p in active), default=0.0),
            "link_layer": best.link_layer if best else None,
            "transport": best.transport if best else None,
            "ports": [
                {
                    "port": p.port,
                    "state": p.state,
                    "phys_state": p.phys_state,
                    "rate": p.rate,
                    "rate_gbps": p.rate_gbps,
                    "link_layer": p.link_layer,
                    "transport": p.transport,
                }
                for p in self.ports
            ],
        }


@dataclass(frozen=True)
class Topology:
    """The device matrix in ``nvidia-smi topo -m`` vocabulary (X, NV#, PIX, PXB, PHB, NODE, SYS)."""

    devices: tuple[str, ...]
    matrix: tuple[tuple[str, ...], ...]
    cpu_affinity: dict[str, str]
    numa_affinity: dict[str, int | None]
    nic_legend: dict[str, str]

    def link(self, a: str, b: str) -> str:
        """The matrix entry between two device labels (``GPU0``, ``NIC3``)."""
        return self.matrix[self.devices.index(a)][self.devices.index(b)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "matrix": [list(row) for row in self.matrix],
            "cpu_affinity": dict(self.cpu_affinity),
            "numa_affinity": dict(self.numa_affinity),
            "nic_legend": dict(self.nic_legend),
        }


@dataclass(frozen=True)
class NodeInventory:
    """Everything gpuyard knows about one machine."""

    hostname: str
    cpu: CpuInfo
    accelerators: tuple[Accelerator, ...]
    topology: Topology
    nics: tuple[Nic, ...]
    driver: dict[str, Any]
    probed_at: str

    @property
    def health(self) -> str:
        """The worst accelerator health on the node (``pass`` with no accelerator)."""
        statuses = [a.health.status for a in self.accelerators] or ["pass"]
        return max(statuses, key=lambda s: HEALTH_ORDER.get(s, 0))

    def to_dict(self) -> dict[str, Any]:
        """The ``gpuyard hw --json`` document: ``{"node": {...}}``."""
        return {
            "node": {
                "hostname": self.hostname,
                "probed_at": self.probed_at,
                "health": self.health,
                "cpu": self.cpu.to_dict(),
                "accelerators": [a.to_dict() for a in self.accelerators],
                "topology": self.topology.to_dict(),
                "nics": [n.to_dict() for n in self.nics],
                "driver": dict(self.driver),
            }
        }
