"""A recorded node for tests and what-if studies: :class:`FakeNvml` answers NVML calls from a JSON
description, and :func:`write_host_tree` lays out the matching /proc and /sys files.

The description (see ``tests/unit/hardware/fixtures/*.json``) has three parts:

* ``nvml``: ``driver_version``, ``cuda_driver_version``, ``gpu_defaults`` (fields shared by every
  GPU), ``gpus`` (per-GPU fields, which override the defaults) and optionally ``topology``
  (``{"0,1": "PIX"}``: NVML's common-ancestor answer per GPU pair). A field that is absent or null
  answers like NVML's ``NOT_SUPPORTED``; ``"lost": true`` makes every call of that GPU fail like
  ``GPU_IS_LOST``.
* ``host``: CPU model/flags/sockets/cores/threads, NUMA CPU lists, memory, and the PCI paths of the
  GPUs and NICs (``pci``) with their NUMA nodes.
* ``infiniband``: RDMA devices with their PCI address, ports (rate, link layer, state) and netdevs.

Faults for the node health checks: :meth:`FakeNvml.inject` puts one of :data:`FAULTS` on a GPU (ECC
errors, Xid 79 and other Xids, throttling, NVLink errors, a lost GPU, a self-test failure) while the
fake is in use; per-GPU ``nvlink.errors`` (``{"dl_replay": N, ...}``, counted on link 0) and
``selftest`` (what :func:`fake_selftest` answers) can also be written in the description.

MIG: a GPU with ``"mig_mode": {"current": true, ...}`` and ``"mig_devices": [{"profile": "1g.10gb",
"uuid": "MIG-..."}, ...]`` presents those slices; :func:`set_mig` puts a GPU of a description in MIG
mode with given profiles (checked against NVIDIA's profile table, UUIDs made up). Only descriptions
change: no real GPU's MIG settings are ever touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuyard.errors import ConfigError
from gpuyard.hardware.inventory import parse_cpu_list

if TYPE_CHECKING:
    from gpuyard.hardware.health import SelfTestResult
    from gpuyard.hardware.inventory import NodeInventory
from gpuyard.hardware.nvml import (
    NVLINK_ERROR_COUNTERS,
    EccCounts,
    MigDevice,
    NvLinkRemote,
    NvmlCallError,
    PcieLink,
    RemappedRows,
    RetiredPages,
)

_ECC_KEYS = ("volatile_corrected", "volatile_uncorrected", "aggregate_corrected", "aggregate_uncorrected")

# Faults FakeNvml.inject knows, and what each does to the GPU's answers.
FAULTS: dict[str, str] = {
    "ecc_uncorrectable": "volatile uncorrectable ECC errors (+count, default 1)",
    "ecc_corrected": "volatile corrected ECC errors (+count, default 1000)",
    "row_remap_pending": "a row remap waits for a GPU reset",
    "xid": "an Xid error event (xid=N, default 79: fallen off the bus)",
    "throttle": "a clock event reason held on (reason=hw_slowdown by default; any CLOCK_EVENT_REASONS name)",
    "nvlink_errors": "NVLink replay errors (+count, default 1000)",
    "lost": "every NVML call of the GPU fails like GPU_IS_LOST",
    "selftest": "the GEMM/memory self-test fails (fake_selftest)",
}


def load_description(path: Path) -> dict[str, Any]:
    """Read a node description file.

    Raises:
        ConfigError: the file is missing or is not a JSON object.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"node description {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"node description {path}: expected a JSON object")
    return data


class FakeNvml:
    """An :class:`gpuyard.hardware.nvml.NvmlBackend` that replays a node description."""

    def __init__(self, description: dict[str, Any]) -> None:
        nvml = description.get("nvml") or {}
        self._nvml = nvml
        defaults = nvml.get("gpu_defaults") or {}
        self._gpus = [{**defaults, **g} for g in nvml.get("gpus") or []]
        self._xids: list[tuple[int, int]] = []

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        """Build the fake from a description file."""
        return cls(load_description(path))

    def _field(self, i: int, name: str) -> Any:
        if i >= len(self._gpus):
            raise NvmlCallError(f"{name}: Invalid Argument (GPU {i})")
        gpu = self._gpus[i]
        if gpu.get("lost"):
            raise NvmlCallError(f"{name}: GPU is lost")
        value = gpu.get(name)
        if value is None:
            raise NvmlCallError(f"{name}: Not Supported", not_supported=True)
        return value

    def _system(self, name: str) -> Any:
        if self._nvml.get("unavailable"):
            raise NvmlCallError(f"{name}: {self._nvml['unavailable']}")
        value = self._nvml.get(name)
        if value is None:
            raise NvmlCallError(f"{name}: Not Supported", not_supported=True)
        return value

    def driver_version(self) -> str:
        return str(self._system("driver_version"))

    def cuda_driver_version(self) -> int:
        return int(self._system("cuda_driver_version"))

    def device_count(self) -> int:
        if self._nvml.get("unavailable"):
            raise NvmlCallError(f"nvmlDeviceGetCount: {self._nvml['unavailable']}")
        return len(self._gpus)

    def name(self, i: int) -> str:
        return str(self._field(i, "name"))

    def uuid(self, i: int) -> str:
        return str(self._field(i, "uuid"))

    def pci_bus_id(self, i: int) -> str:
        return str(self._field(i, "bus_id"))

    def memory(self, i: int) -> tuple[int, int]:
        m = self._field(i, "memory")
        return int(m["total"]), int(m["used"])

    def compute_capability(self, i: int) -> tuple[int, int]:
        major, minor = self._field(i, "compute_capability")
        return int(major), int(minor)

    def power_draw_w(self, i: int) -> float:
        return float(self._field(i, "power_draw_w"))

    def power_limit_w(self, i: int) -> float:
        return float(self._field(i, "power_limit_w"))

    def temperature_c(self, i: int) -> int:
        return int(self._field(i, "temperature_c"))

    def slowdown_temperature_c(self, i: int) -> int:
        return int(self._field(i, "slowdown_temperature_c"))

    def utilization(self, i: int) -> tuple[int, int]:
        u = self._field(i, "utilization")
        return int(u["gpu"]), int(u["memory"])

    def ecc_enabled(self, i: int) -> bool:
        return bool(self._field(i, "ecc_enabled"))

    def ecc_counts(self, i: int) -> EccCounts:
        return EccCounts(**self._field(i, "ecc"))

    def retired_pages(self, i: int) -> RetiredPages:
        return RetiredPages(**self._field(i, "retired_pages"))

    def remapped_rows(self, i: int) -> RemappedRows:
        return RemappedRows(**self._field(i, "remapped_rows"))

    def clock_event_reasons(self, i: int) -> int:
        return int(self._field(i, "clock_event_reasons"))

    def mig_mode(self, i: int) -> tuple[bool, bool]:
        m = self._field(i, "mig_mode")
        return bool(m["current"]), bool(m["pending"])

    def mig_devices(self, i: int) -> list[MigDevice]:
        if not self.mig_mode(i)[0]:
            raise NvmlCallError("nvmlDeviceGetMigDeviceHandleByIndex: Not Found (MIG mode is off)")
        devices = self._gpus[i].get("mig_devices") or []
        return [
            MigDevice(
                index=k, uuid=str(d["uuid"]), profile=d.get("profile"), memory_bytes=d.get("memory_bytes")
            )
            for k, d in enumerate(devices)
        ]

    def pcie_link(self, i: int) -> PcieLink:
        return PcieLink(**self._field(i, "pcie"))

    def cpu_affinity(self, i: int) -> list[int]:
        return parse_cpu_list(str(self._field(i, "cpu_affinity")))

    def nvlink_max_links(self) -> int:
        return int(self._nvml.get("nvlink_max_links", 18))

    def _links(self, i: int) -> list[dict[str, Any]]:
        # "version" is NVML's raw nvmlNvlinkVersion_t code (6 = NVLink 4.0 on H100).
        # "nvlink": {"version": 6, "remote_kind": "switch", "peers": {"00000000:05:00.0": 4, ...},
        #            "down": 0} expands to one entry per link, peers in the order given.
        spec = self._field(i, "nvlink")
        links: list[dict[str, Any]] = []
        for bus, count in spec["peers"].items():
            links += [{"bus": bus, "kind": spec.get("remote_kind", "gpu"), "up": True}] * int(count)
        links += [{"bus": None, "kind": "unknown", "up": False}] * int(spec.get("down", 0))
        return [{**link, "version": spec.get("version")} for link in links]

    def _link(self, i: int, link: int) -> dict[str, Any]:
        links = self._links(i)
        if link >= len(links):
            raise NvmlCallError(f"nvlink {link}: Invalid Argument")
        return links[link]

    def nvlink_active(self, i: int, link: int) -> bool:
        return bool(self._link(i, link)["up"])

    def nvlink_version(self, i: int, link: int) -> int:
        version = self._link(i, link)["version"]
        if version is None:
            raise NvmlCallError("nvmlDeviceGetNvLinkVersion: Not Supported", not_supported=True)
        return int(version)

    def common_ancestor(self, i: int, j: int) -> str:
        # "topology": {"0,1": "PIX", ...}: what NVML says when sysfs cannot be read.
        table = self._nvml.get("topology") or {}
        value = table.get(f"{min(i, j)},{max(i, j)}")
        if value is None:
            raise NvmlCallError("nvmlDeviceGetTopologyCommonAncestor: Not Supported", not_supported=True)
        return str(value)

    def nvlink_remote(self, i: int, link: int) -> NvLinkRemote:
        entry = self._link(i, link)
        return NvLinkRemote(bus_id=str(entry["bus"]), kind=str(entry["kind"]))

    def nvlink_error_counter(self, i: int, link: int, counter: int) -> int:
        self._link(i, link)
        errors = self._field(i, "nvlink").get("errors") or {}
        return int(errors.get(NVLINK_ERROR_COUNTERS[counter], 0)) if link == 0 else 0

    def xid_events(self) -> list[tuple[int, int]]:
        events, self._xids = self._xids, []
        return events

    # -- fault injection --------------------------------------------------------------------------

    def inject(self, gpu: int, fault: str, count: int | None = None, xid: int = 79, reason: str = "") -> None:
        """Put one fault on GPU ``gpu`` (see :data:`FAULTS`); faults add up.

        Raises:
            ConfigError: an unknown fault or GPU index.
        """
        if fault not in FAULTS:
            raise ConfigError(f"fault {fault!r} is unknown; known: {', '.join(FAULTS)}")
        if not 0 <= gpu < len(self._gpus):
            raise ConfigError(f"GPU {gpu}: the fake node has {len(self._gpus)} GPUs")
        g = self._gpus[gpu]
        if fault in ("ecc_uncorrectable", "ecc_corrected"):
            ecc = dict(g.get("ecc") or dict.fromkeys(_ECC_KEYS, 0))
            kind = "uncorrected" if fault == "ecc_uncorrectable" else "corrected"
            n = count if count is not None else (1 if kind == "uncorrected" else 1000)
            for scope in ("volatile", "aggregate"):
                ecc[f"{scope}_{kind}"] = int(ecc.get(f"{scope}_{kind}") or 0) + n
            g["ecc"] = ecc
        elif fault == "row_remap_pending":
            rows = dict(g.get("remapped_rows") or {"corrected": 0, "uncorrected": 0, "failed": False})
            g["remapped_rows"] = {**rows, "uncorrected": int(rows["uncorrected"]) + 1, "pending": True}
        elif fault == "xid":
            self._xids.append((gpu, xid))
        elif fault == "throttle":
            from gpuyard.hardware.nvml import CLOCK_EVENT_REASONS

            bits = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
            name = reason or "hw_slowdown"
            if name not in bits:
                raise ConfigError(f"clock event reason {name!r} is unknown; known: {', '.join(bits)}")
            g["clock_event_reasons"] = int(g.get("clock_event_reasons") or 0) | bits[name]
        elif fault == "nvlink_errors":
            spec = dict(g.get("nvlink") or {})
            if not spec:
                raise ConfigError(f"GPU {gpu} has no NVLinks to put errors on")
            errors = dict(spec.get("errors") or {})
            errors["dl_replay"] = int(errors.get("dl_replay", 0)) + (count if count is not None else 1000)
            g["nvlink"] = {**spec, "errors": errors}
        elif fault == "lost":
            g["lost"] = True
        else:
            g["selftest"] = {"ok": False, "error": reason or "GEMM result differs from the reference"}

    def clear(self, gpu: int) -> None:
        """Take every injected fault off GPU ``gpu`` (as a GPU reset would): ECC volatile counters, pending
        remaps, clock events, NVLink errors, lost, self-test; pending Xids of that GPU are dropped."""
        g = self._gpus[gpu]
        ecc = g.get("ecc")
        if ecc:
            g["ecc"] = {**ecc, "volatile_corrected": 0, "volatile_uncorrected": 0}
        if g.get("remapped_rows"):
            g["remapped_rows"] = {**g["remapped_rows"], "pending": False}
        g["clock_event_reasons"] = 0 if g.get("clock_event_reasons") is not None else None
        if g.get("nvlink"):
            g["nvlink"] = {k: v for k, v in g["nvlink"].items() if k != "errors"}
        g.pop("lost", None)
        g.pop("selftest", None)
        self._xids = [(i, x) for i, x in self._xids if i != gpu]

    def selftest_answer(self, gpu: int) -> dict[str, Any] | None:
        """The ``selftest`` entry of a GPU (None: it passes); used by :func:`fake_selftest`."""
        return self._gpus[gpu].get("selftest") if gpu < len(self._gpus) else None


def replay_inventory(path: Path, hostname: str) -> NodeInventory:
    """Probe a node description file (FakeNvml, its /proc and /sys laid out in a temporary folder)."""
    import tempfile

    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.sysfs import HostRoots

    desc = load_description(path)
    with tempfile.TemporaryDirectory(prefix="gpuyard-replay-") as tmp:
        roots = HostRoots.under(write_host_tree(desc, Path(tmp)))
        return probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname=hostname)


def set_mig(description: dict[str, Any], gpu: int, profiles: list[str]) -> list[str]:
    """Put GPU ``gpu`` of a node description in MIG mode with one slice per profile; returns their UUIDs.

    The profiles are checked against NVIDIA's table for the GPU's model (A100 40GB/80GB, H100 80GB:
    :mod:`gpuyard.hardware.mig`); an empty list leaves the GPU in MIG mode with no slices. The UUIDs are
    made up, stable for a GPU UUID and slice index.

    Raises:
        ConfigError: no such GPU, a GPU without MIG, or slices that one GPU cannot hold.
    """
    import uuid as uuidlib

    from gpuyard.hardware.mig import check_layout, mig_model, profiles_of

    nvml = description.setdefault("nvml", {})
    gpus = nvml.get("gpus") or []
    if not 0 <= gpu < len(gpus):
        raise ConfigError(f"GPU {gpu}: the description has {len(gpus)} GPUs")
    g = {**(nvml.get("gpu_defaults") or {}), **gpus[gpu]}
    model = mig_model(str(g.get("name", "")))
    if model is None:
        raise ConfigError(f"GPU {gpu} ({g.get('name')}) has no MIG profiles here")
    try:
        check_layout(model, profiles)
    except ValueError as exc:
        raise ConfigError(f"GPU {gpu}: {exc}") from None
    sizes = {p.name: p for p in profiles_of(model)}
    total = int((g.get("memory") or {}).get("total", 0))
    devices: list[dict[str, Any]] = []
    for k, name in enumerate(profiles):
        uid = uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"{g.get('uuid', gpu)}/mig/{k}")
        memory = total * sizes[name].memory // 8 if total else None
        devices.append({"profile": name, "uuid": f"MIG-{uid}", "memory_bytes": memory})
    gpus[gpu] = {**gpus[gpu], "mig_mode": {"current": True, "pending": True}, "mig_devices": devices}
    return [str(d["uuid"]) for d in devices]


def fake_selftest(fake: FakeNvml) -> Callable[[int], SelfTestResult]:
    """A self-test runner for :func:`gpuyard.hardware.health.check_node` on a fake node: a GPU passes
    (figures of an H100 SXM) unless its ``selftest`` entry (or an injected ``selftest`` fault) says
    otherwise."""
    from gpuyard.hardware.health import SelfTestResult

    def run(gpu: int) -> SelfTestResult:
        answer = fake.selftest_answer(gpu)
        passed = {"ok": True, "seconds": 0.5, "gemm_tflops": 51.0, "gemm_rel_err": 1e-6}
        return SelfTestResult(**{**passed, "gemm_repeat_mismatches": 0, "memory_errors": 0, **(answer or {})})

    return run


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _cpuinfo(host: dict[str, Any]) -> str:
    cpu = host["cpu"]
    sockets, cores, threads = int(cpu["sockets"]), int(cpu["cores_per_socket"]), int(cpu["threads_per_core"])
    # "socket-major" numbers every thread of socket 0 first (cpus 0-79 on node 0); "thread-major"
    # numbers first threads of all sockets, then the siblings (0-95,192-287 on node 0).
    if cpu.get("numbering", "socket-major") == "thread-major":
        order = [(s, t, c) for t in range(threads) for s in range(sockets) for c in range(cores)]
    else:
        order = [(s, t, c) for s in range(sockets) for t in range(threads) for c in range(cores)]
    blocks = []
    for n, (s, _t, c) in enumerate(order):
        blocks.append(
            f"processor\t: {n}\nvendor_id\t: {cpu['vendor_id']}\nmodel name\t: {cpu['model']}\n"
            f"physical id\t: {s}\ncore id\t\t: {c}\ncpu cores\t: {cores}\nflags\t\t: {cpu['flags']}\n"
        )
    return "\n".join(blocks)


def write_host_tree(description: dict[str, Any], root: Path) -> Path:
    """Lay out ``root/proc`` and ``root/sys`` for a node description; returns ``root``.

    Use with ``HostRoots.under(root)``. Logical CPU numbering follows the NUMA ``cpus`` lists of the
    description, so a GPU's CPU affinity lines up with its node as in the recorded output.
    """
    host = description.get("host") or {}
    sysd = root / "sys"
    if "cpu" in host:
        _write(root / "proc" / "cpuinfo", _cpuinfo(host))
    if "memory_kb" in host:
        _write(root / "proc" / "meminfo", f"MemTotal:       {int(host['memory_kb'])} kB")
    for node, spec in (host.get("numa") or {}).items():
        d = sysd / "devices" / "system" / "node" / f"node{node}"
        _write(d / "cpulist", spec["cpus"])
        _write(d / "meminfo", f"Node {node} MemTotal:       {int(spec['memory_kb'])} kB")
    for bus_id, spec in (host.get("pci") or {}).items():
        real = sysd / "devices" / spec["path"]
        _write(real / "numa_node", str(spec.get("numa_node", -1)))
        link = sysd / "bus" / "pci" / "devices" / bus_id
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(real)
    for name, spec in (description.get("infiniband") or {}).items():
        dev = sysd / "class" / "infiniband" / name
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "device").symlink_to(sysd / "bus" / "pci" / "devices" / spec["bus_id"])
        for key in ("hca_type", "fw_ver"):
            if key in spec:
                _write(dev / key, spec[key])
        for netdev in spec.get("netdevs", []):
            (sysd / "bus" / "pci" / "devices" / spec["bus_id"] / "net" / netdev).mkdir(
                parents=True, exist_ok=True
            )
        for port, fields in spec.get("ports", {}).items():
            for key, value in fields.items():
                _write(dev / "ports" / str(port) / key, value)
    return root
