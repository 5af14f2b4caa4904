"""NVIDIA GPUs through the NVML seam: one :class:`Accelerator` per device, every field fetched on its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from gpuyard.hardware.cpu import numa_of_cpus
from gpuyard.hardware.health import GpuSignals, HealthThresholds, assess, decode_clock_events
from gpuyard.hardware.inventory import Accelerator, CpuInfo, NvLinkInfo, NvLinkPeer
from gpuyard.hardware.nvml import (
    NVLINK_VERSIONS,
    EccCounts,
    NvmlBackend,
    NvmlCallError,
    PcieLink,
    RemappedRows,
    RetiredPages,
    normalize_bus_id,
)
from gpuyard.hardware.sysfs import HostRoots, pci_device_dir, read_int

T = TypeVar("T")


class _Fields:
    """Calls one NVML getter per field and remembers, per field, why it is missing."""

    def __init__(self) -> None:
        self.missing: dict[str, str] = {}

    def get(self, field: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except NvmlCallError as exc:
            self.missing[field] = "not supported" if exc.not_supported else str(exc)
            return None


def _nvlinks(nv: NvmlBackend, i: int, f: _Fields) -> NvLinkInfo | None:
    active = inactive = 0
    version: str | None = None
    peers: dict[tuple[str, str], int] = {}
    try:
        max_links = nv.nvlink_max_links()
    except NvmlCallError:
        max_links = 18
    for link in range(max_links):
        try:
            up = nv.nvlink_active(i, link)
        except NvmlCallError as exc:
            if link == 0 and exc.not_supported:
                f.missing["nvlink"] = "not supported"
                return None
            continue  # links past the GPU's own count answer "invalid argument"
        if not up:
            inactive += 1
            continue
        active += 1
        code = f.get("nvlink.version", nv.nvlink_version, i, link)
        if code is not None:
            version = NVLINK_VERSIONS.get(code, version)
        remote = f.get("nvlink.peers", nv.nvlink_remote, i, link)
        if remote is not None:
            key = (normalize_bus_id(remote.bus_id), remote.kind)
            peers[key] = peers.get(key, 0) + 1
    if not active:
        if inactive:
            # e.g. a PCIe A100 without its bridge: links exist but none is up; report no NVLink.
            f.missing["nvlink"] = f"{inactive} links, none active"
        return None
    return NvLinkInfo(
        version=version,
        active_links=active,
        inactive_links=inactive,
        peers=tuple(NvLinkPeer(bus_id=b, kind=k, links=n) for (b, k), n in sorted(peers.items())),
    )


def _numa(bus_id: str | None, affinity: list[int], roots: HostRoots, cpu: CpuInfo) -> int | None:
    if bus_id is not None:
        node = read_int(pci_device_dir(bus_id, roots.sys) / "numa_node")
        if node is not None and node >= 0:
            return node
    if affinity:
        # The kernel prints -1 on one-node machines and some VMs: fall back to where the GPU's CPUs live.
        for n in cpu.numa_nodes:
            if set(affinity) <= set(n.cpus):
                return n.id
    if len(cpu.numa_nodes) == 1:
        return cpu.numa_nodes[0].id
    return numa_of_cpus(affinity, cpu.numa_nodes) if affinity else None


def _spec(name: str) -> dict[str, Any] | None:
    try:
        from gpuyard.hardware.catalog import match_spec
    except ImportError:
        return None
    spec = match_spec(name)
    if spec is None:
        return None
    return {
        "name": spec.name,
        "peak_tflops": {d: getattr(spec, f"{d}_tflops") for d in ("fp32", "tf32", "bf16", "fp16", "fp8")},
        "memory_bw_GBps": spec.memory_bw_GBps,
        "interconnect": spec.interconnect,
        "interconnect_GBps": spec.interconnect_GBps,
    }


@dataclasses.dataclass(frozen=True)
class _Readings:
    """The moment's counters of one GPU, each None when NVML could not give it."""

    power_w: float | None
    power_limit_w: float | None
    temperature_c: int | None
    slowdown_c: int | None
    utilization: tuple[int, int] | None
    ecc_enabled: bool | None
    ecc: EccCounts | None
    retired: RetiredPages | None
    remapped: RemappedRows | None
    events: tuple[str, ...]

    def to_dict(self, memory_used: int | None) -> dict[str, Any]:
        util = self.utilization
        return {
            "memory_used_bytes": memory_used,
            "power_w": self.power_w,
            "power_limit_w": self.power_limit_w,
            "temperature_c": self.temperature_c,
            "slowdown_temperature_c": self.slowdown_c,
            "utilization": {"gpu": util[0], "memory": util[1]} if util else None,
            "ecc_enabled": self.ecc_enabled,
            "ecc": dataclasses.asdict(self.ecc) if self.ecc else None,
            "retired_pages": dataclasses.asdict(self.retired) if self.retired else None,
            "remapped_rows": dataclasses.asdict(self.remapped) if self.remapped else None,
            "clock_event_reasons": list(self.events),
        }


def _readings(nv: NvmlBackend, i: int, f: _Fields) -> _Readings:
    mask = f.get("clock_event_reasons", nv.clock_event_reasons, i)
    return _Readings(
        power_w=f.get("power_w", nv.power_draw_w, i),
        power_limit_w=f.get("power_limit_w", nv.power_limit_w, i),
        temperature_c=f.get("temperature_c", nv.temperature_c, i),
        slowdown_c=f.get("slowdown_temperature_c", nv.slowdown_temperature_c, i),
        utilization=f.get("utilization", nv.utilization, i),
        ecc_enabled=f.get("ecc_enabled", nv.ecc_enabled, i),
        ecc=f.get("ecc", nv.ecc_counts, i),
        retired=f.get("retired_pages", nv.retired_pages, i),
        remapped=f.get("remapped_rows", nv.remapped_rows, i),
        events=decode_clock_events(mask) if mask is not None else (),
    )


def _signals(
    r: _Readings, pcie: PcieLink | None, nvlink: NvLinkInfo | None, mig: tuple[bool, bool] | None
) -> GpuSignals:
    return GpuSignals(
        ecc_enabled=r.ecc_enabled,
        ecc=r.ecc,
        retired=r.retired,
        remapped=r.remapped,
        clock_events=r.events,
        temperature_c=r.temperature_c,
        slowdown_temperature_c=r.slowdown_c,
        pcie_width=pcie.width if pcie else None,
        pcie_max_width=pcie.max_width if pcie else None,
        nvlink_active=nvlink.active_links if nvlink else 0,
        nvlink_inactive=nvlink.inactive_links if nvlink else 0,
        mig_pending_change=bool(mig and mig[0] != mig[1]),
    )


def _mig(nv: NvmlBackend, i: int, mode: tuple[bool, bool] | None, f: _Fields) -> dict[str, Any] | None:
    """MIG mode, and in MIG mode the MIG devices (uuid, profile, memory) when NVML can list them."""
    if mode is None:
        return None
    doc: dict[str, Any] = {"enabled": mode[0], "pending": mode[1]}
    if mode[0] and hasattr(nv, "mig_devices"):
        devices = f.get("mig.devices", nv.mig_devices, i)
        if devices is not None:
            doc["devices"] = [dataclasses.asdict(d) for d in devices]
    return doc


def _unreachable(i: int, f: _Fields) -> Accelerator:
    why = f.missing.get("name", "no answer")
    health = assess(GpuSignals(reachable=False, unreachable_reason=f"NVML cannot query GPU {i}: {why}"))
    return Accelerator(
        index=i,
        kind="cuda",
        vendor="nvidia",
        name="unknown",
        uuid=None,
        memory_bytes=None,
        compute_capability=None,
        health=health,
        unavailable=dict(f.missing),
    )


def probe_gpu(
    nv: NvmlBackend, i: int, roots: HostRoots, cpu: CpuInfo, thresholds: HealthThresholds | None = None
) -> Accelerator:
    """Describe NVML device ``i``; a field NVML cannot give is None and listed in ``unavailable``."""
    f = _Fields()
    name, uuid = f.get("name", nv.name, i), f.get("uuid", nv.uuid, i)
    if name is None and uuid is None:
        return _unreachable(i, f)
    raw_bus = f.get("bus_id", nv.pci_bus_id, i)
    bus_id = normalize_bus_id(raw_bus) if raw_bus else None
    memory = f.get("memory", nv.memory, i)
    cc = f.get("compute_capability", nv.compute_capability, i)
    affinity = f.get("cpu_affinity", nv.cpu_affinity, i) or []
    pcie = f.get("pcie", nv.pcie_link, i)
    mig = f.get("mig", nv.mig_mode, i)
    nvlink = _nvlinks(nv, i, f)
    readings = _readings(nv, i, f)
    return Accelerator(
        index=i,
        kind="cuda",
        vendor="nvidia",
        name=name or "unknown",
        uuid=uuid,
        memory_bytes=memory[0] if memory else None,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        bus_id=bus_id,
        numa=_numa(bus_id, affinity, roots, cpu),
        cpu_affinity=tuple(affinity),
        pcie=dataclasses.asdict(pcie) if pcie else None,
        nvlink=nvlink,
        mig=_mig(nv, i, mig, f),
        telemetry=readings.to_dict(memory[1] if memory else None),
        health=assess(_signals(readings, pcie, nvlink, mig), thresholds),
        spec=_spec(name) if name else None,
        source="nvml",
        unavailable=dict(f.missing),
    )


def link_gpu_peers(gpus: list[Accelerator]) -> list[Accelerator]:
    """Fill ``gpu_index`` in NVLink peers that are GPUs of this node (matched by PCI bus id)."""
    by_bus = {g.bus_id: g.index for g in gpus if g.bus_id}
    out = []
    for g in gpus:
        if g.nvlink is None:
            out.append(g)
            continue
        peers = tuple(
            dataclasses.replace(p, gpu_index=by_bus.get(p.bus_id)) if p.kind == "gpu" else p
            for p in g.nvlink.peers
        )
        out.append(dataclasses.replace(g, nvlink=dataclasses.replace(g.nvlink, peers=peers)))
    return out


def probe_nvidia(
    nv: NvmlBackend, roots: HostRoots, cpu: CpuInfo, thresholds: HealthThresholds | None = None
) -> tuple[list[Accelerator], dict[str, Any]]:
    """Every NVML device and the driver facts; a dead NVML gives ``([], {"nvml": False, ...})``."""
    driver: dict[str, Any] = {
        "nvml": True,
        "driver_version": None,
        "cuda_driver_version": None,
        "error": None,
    }
    try:
        count = nv.device_count()
    except NvmlCallError as exc:
        return [], {**driver, "nvml": False, "error": str(exc)}
    try:
        driver["driver_version"] = nv.driver_version()
        cuda = nv.cuda_driver_version()
        driver["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except NvmlCallError as exc:
        driver["error"] = str(exc)
    gpus = [probe_gpu(nv, i, roots, cpu, thresholds) for i in range(count)]
    return link_gpu_peers(gpus), driver
