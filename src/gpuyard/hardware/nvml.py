"""A small seam around NVIDIA's NVML (nvidia-ml-py): the calls the inventory makes, and nothing else.

The probe talks to :class:`NvmlBackend`, never to ``pynvml`` directly, so tests inject a fake
(:class:`gpuyard.hardware.fake.FakeNvml`) and a machine without the library or the driver simply has
no backend. Every method may raise :class:`NvmlCallError`; the probe catches it per field, so a call
that a GPU does not support (``NVML_ERROR_NOT_SUPPORTED``) costs one field, never the inventory.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

# Bits of nvmlClocksEventReasons (formerly "throttle reasons"), from nvml.h. Names are the suffixes
# NVML uses, so they can be looked up in NVIDIA's documentation.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# nvmlGpuTopologyLevel_t (nvml.h) in nvidia-smi's words: INTERNAL and SINGLE are one switch (PIX),
# MULTIPLE several switches (PXB), then HOSTBRIDGE, NODE and SYSTEM.
TOPOLOGY_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

# nvmlDeviceGetNvLinkVersion returns an nvmlNvlinkVersion_t code, not the generation: an A100
# answers 5 (NVLink 3.1) and an H100 6 (NVLink 4.0). hwloc was bitten by this (open-mpi/hwloc #658).
NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}

# nvmlNvLinkDeviceType values (nvml.h): what sits at the far end of an NVLink.
NVLINK_REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 255: "unknown"}

# nvmlNvLinkErrorCounter_t (nvml.h): the data-link error counters of one NVLink, cumulative since the
# driver loaded (or the counters were reset). Replays and recoveries are retransmissions the link
# absorbed; a rising count means a marginal link (cable, connector, NVSwitch port).
NVLINK_ERROR_COUNTERS: dict[int, str] = {
    0: "dl_replay",
    1: "dl_recovery",
    2: "dl_crc_flit",
    3: "dl_crc_data",
}

# nvmlEventTypeXidCriticalError (nvml.h): the event mask that delivers Xid errors.
XID_CRITICAL_ERROR_EVENT = 0x8


class NvmlCallError(Exception):
    """One NVML call failed; ``not_supported`` when the GPU or driver lacks the feature."""

    def __init__(self, message: str, *, not_supported: bool = False) -> None:
        super().__init__(message)
        self.not_supported = not_supported


@dataclass(frozen=True)
class EccCounts:
    """ECC error counters of one GPU: volatile (since the driver loaded) and aggregate (lifetime)."""

    volatile_corrected: int | None
    volatile_uncorrected: int | None
    aggregate_corrected: int | None
    aggregate_uncorrected: int | None


@dataclass(frozen=True)
class RetiredPages:
    """Dynamic page retirement (pre-Ampere): pages retired per cause and whether a retirement is pending."""

    single_bit: int
    double_bit: int
    pending: bool


@dataclass(frozen=True)
class RemappedRows:
    """Row remapping (Ampere and later): rows remapped per cause, pending remaps, remapping failure."""

    corrected: int
    uncorrected: int
    pending: bool
    failed: bool


@dataclass(frozen=True)
class PcieLink:
    """PCIe link generation and width, current and maximum."""

    gen: int
    width: int
    max_gen: int
    max_width: int


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a GPU instance with its compute instance) of a GPU in MIG mode.

    Attributes:
        index: the MIG device's index on its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``).
        uuid: ``MIG-...``: what ``CUDA_VISIBLE_DEVICES`` takes to show a process only this slice.
        profile: the GPU instance profile, e.g. ``1g.10gb`` (None when NVML's name does not say).
        memory_bytes: the slice's memory (None when unknown).
    """

    index: int
    uuid: str
    profile: str | None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class NvLinkRemote:
    """The far end of one NVLink: its PCI bus id and its kind (gpu, switch, ibmnpu, unknown)."""

    bus_id: str
    kind: str


class NvmlBackend(Protocol):
    """The NVML calls the inventory uses. ``i`` is the NVML device index; every method may raise
    :class:`NvmlCallError`."""

    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int: ...
    def device_count(self) -> int: ...
    def name(self, i: int) -> str: ...
    def uuid(self, i: int) -> str: ...
    def pci_bus_id(self, i: int) -> str: ...
    def memory(self, i: int) -> tuple[int, int]: ...
    def compute_capability(self, i: int) -> tuple[int, int]: ...
    def power_draw_w(self, i: int) -> float: ...
    def power_limit_w(self, i: int) -> float: ...
    def temperature_c(self, i: int) -> int: ...
    def slowdown_temperature_c(self, i: int) -> int: ...
    def utilization(self, i: int) -> tuple[int, int]: ...
    def ecc_enabled(self, i: int) -> bool: ...
    def ecc_counts(self, i: int) -> EccCounts: ...
    def retired_pages(self, i: int) -> RetiredPages: ...
    def remapped_rows(self, i: int) -> RemappedRows: ...
    def clock_event_reasons(self, i: int) -> int: ...
    def mig_mode(self, i: int) -> tuple[bool, bool]: ...
    def mig_devices(self, i: int) -> list[MigDevice]: ...  # read only: MIG is never reconfigured here
    def pcie_link(self, i: int) -> PcieLink: ...
    def cpu_affinity(self, i: int) -> list[int]: ...
    def nvlink_max_links(self) -> int: ...
    def nvlink_active(self, i: int, link: int) -> bool: ...
    def nvlink_version(self, i: int, link: int) -> int: ...  # the raw nvmlNvlinkVersion_t code
    def nvlink_remote(self, i: int, link: int) -> NvLinkRemote: ...
    def common_ancestor(self, i: int, j: int) -> str: ...


class HealthNvmlBackend(NvmlBackend, Protocol):
    """What the periodic node health check needs beyond the inventory's calls (see
    :mod:`gpuyard.hardware.health`): NVLink error counters and the Xid errors seen since the last call."""

    def nvlink_error_counter(self, i: int, link: int, counter: int) -> int: ...
    def xid_events(self) -> list[tuple[int, int]]: ...  # (GPU index, Xid) pairs, oldest first


def normalize_bus_id(bus_id: str | bytes) -> str:
    """Turn an NVML bus id (``00000000:18:00.0``) into the sysfs form (``0000:18:00.0``), lower case."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().lower()
    domain, _, rest = text.partition(":")
    if not rest:
        return text
    return f"{int(domain, 16):04x}:{rest}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """:class:`NvmlBackend` over the real ``pynvml`` module; NVMLError becomes NvmlCallError."""

    def __init__(self, pynvml: Any) -> None:
        self._nv = pynvml
        self._handles: dict[int, Any] = {}
        self._events: Any = None  # the Xid event set, created on the first xid_events()

    def _call(self, fn: str, *args: Any) -> Any:
        nv = self._nv
        try:
            return getattr(nv, fn)(*args)
        except nv.NVMLError as exc:
            unsupported = getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED
            raise NvmlCallError(f"{fn}: {exc}", not_supported=unsupported) from exc
        except AttributeError as exc:  # an older nvidia-ml-py without this function
            raise NvmlCallError(f"{fn}: not in this nvidia-ml-py", not_supported=True) from exc

    def _h(self, i: int) -> Any:
        if i not in self._handles:
            self._handles[i] = self._call("nvmlDeviceGetHandleByIndex", i)
        return self._handles[i]

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> int:
        return int(self._call("nvmlSystemGetCudaDriverVersion"))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def name(self, i: int) -> str:
        return _text(self._call("nvmlDeviceGetName", self._h(i)))

    def uuid(self, i: int) -> str:
        return _text(self._call("nvmlDeviceGetUUID", self._h(i)))

    def pci_bus_id(self, i: int) -> str:
        return _text(self._call("nvmlDeviceGetPciInfo", self._h(i)).busId)

    def memory(self, i: int) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._h(i))
        return int(info.total), int(info.used)

    def compute_capability(self, i: int) -> tuple[int, int]:
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", self._h(i))
        return int(major), int(minor)

    def power_draw_w(self, i: int) -> float:
        return self._call("nvmlDeviceGetPowerUsage", self._h(i)) / 1000.0

    def power_limit_w(self, i: int) -> float:
        return self._call("nvmlDeviceGetEnforcedPowerLimit", self._h(i)) / 1000.0

    def temperature_c(self, i: int) -> int:
        return int(self._call("nvmlDeviceGetTemperature", self._h(i), self._nv.NVML_TEMPERATURE_GPU))

    def slowdown_temperature_c(self, i: int) -> int:
        kind = self._nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return int(self._call("nvmlDeviceGetTemperatureThreshold", self._h(i), kind))

    def utilization(self, i: int) -> tuple[int, int]:
        rates = self._call("nvmlDeviceGetUtilizationRates", self._h(i))
        return int(rates.gpu), int(rates.memory)

    def ecc_enabled(self, i: int) -> bool:
        current, _pending = self._call("nvmlDeviceGetEccMode", self._h(i))
        return bool(current)

    def ecc_counts(self, i: int) -> EccCounts:
        nv, h = self._nv, self._h(i)

        def count(kind: int, counter: int) -> int | None:
            try:
                return int(self._call("nvmlDeviceGetTotalEccErrors", h, kind, counter))
            except NvmlCallError:
                return None

        corr, unc = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        vol, agg = nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
        counts = EccCounts(count(corr, vol), count(unc, vol), count(corr, agg), count(unc, agg))
        if all(v is None for v in vars(counts).values()):
            raise NvmlCallError("nvmlDeviceGetTotalEccErrors: no counter available", not_supported=True)
        return counts

    def retired_pages(self, i: int) -> RetiredPages:
        nv, h = self._nv, self._h(i)
        sbe = self._call(
            "nvmlDeviceGetRetiredPages", h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        dbe = self._call("nvmlDeviceGetRetiredPages", h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus", h) == nv.NVML_FEATURE_ENABLED
        return RetiredPages(single_bit=len(sbe), double_bit=len(dbe), pending=bool(pending))

    def remapped_rows(self, i: int) -> RemappedRows:
        corr, unc, pending, failed = self._call("nvmlDeviceGetRemappedRows", self._h(i))
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failed))

    def clock_event_reasons(self, i: int) -> int:
        try:
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", self._h(i)))
        except NvmlCallError:
            # Drivers before r535 only know the older name of the same bitmask.
            return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", self._h(i)))

    def mig_mode(self, i: int) -> tuple[bool, bool]:
        current, pending = self._call("nvmlDeviceGetMigMode", self._h(i))
        return bool(current), bool(pending)

    def mig_devices(self, i: int) -> list[MigDevice]:
        """The MIG devices of GPU ``i`` (in MIG mode), by read-only queries; the profile comes from the
        device's name (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``)."""
        from gpuyard.hardware.mig import profile_from_name

        h = self._h(i)
        out: list[MigDevice] = []
        for k in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, k)
            except NvmlCallError:
                continue  # no instance at this index (NVML answers NOT_FOUND)
            name = _text(self._call("nvmlDeviceGetName", mig))
            try:
                memory: int | None = int(self._call("nvmlDeviceGetMemoryInfo", mig).total)
            except NvmlCallError:
                memory = None
            uuid = _text(self._call("nvmlDeviceGetUUID", mig))
            out.append(MigDevice(index=k, uuid=uuid, profile=profile_from_name(name), memory_bytes=memory))
        return out

    def pcie_link(self, i: int) -> PcieLink:
        h = self._h(i)
        return PcieLink(
            gen=int(self._call("nvmlDeviceGetCurrPcieLinkGeneration", h)),
            width=int(self._call("nvmlDeviceGetCurrPcieLinkWidth", h)),
            max_gen=int(self._call("nvmlDeviceGetMaxPcieLinkGeneration", h)),
            max_width=int(self._call("nvmlDeviceGetMaxPcieLinkWidth", h)),
        )

    def cpu_affinity(self, i: int) -> list[int]:
        import os

        words = max(1, ((os.cpu_count() or 64) + 63) // 64)
        mask = self._call("nvmlDeviceGetCpuAffinity", self._h(i), words)
        return [w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1]

    def nvlink_max_links(self) -> int:
        return int(getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18))

    def nvlink_active(self, i: int, link: int) -> bool:
        return self._call("nvmlDeviceGetNvLinkState", self._h(i), link) == self._nv.NVML_FEATURE_ENABLED

    def nvlink_version(self, i: int, link: int) -> int:
        return int(self._call("nvmlDeviceGetNvLinkVersion", self._h(i), link))

    def nvlink_remote(self, i: int, link: int) -> NvLinkRemote:
        h = self._h(i)
        bus = _text(self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, link).busId)
        try:
            kind = NVLINK_REMOTE_TYPES.get(
                int(self._call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)), "unknown"
            )
        except NvmlCallError:
            kind = "unknown"
        return NvLinkRemote(bus_id=bus, kind=kind)

    def common_ancestor(self, i: int, j: int) -> str:
        level = int(self._call("nvmlDeviceGetTopologyCommonAncestor", self._h(i), self._h(j)))
        if level not in TOPOLOGY_LEVELS:
            raise NvmlCallError(f"nvmlDeviceGetTopologyCommonAncestor: unknown level {level}")
        return TOPOLOGY_LEVELS[level]

    def nvlink_error_counter(self, i: int, link: int, counter: int) -> int:
        return int(self._call("nvmlDeviceGetNvLinkErrorCounter", self._h(i), link, counter))

    def xid_events(self) -> list[tuple[int, int]]:
        """Xid errors delivered since the previous call (the first call registers for them: Xids from
        before it are not seen). Never blocks."""
        nv = self._nv
        if self._events is None:
            events = self._call("nvmlEventSetCreate")
            for i in range(self.device_count()):
                with contextlib.suppress(NvmlCallError):  # a GPU without Xid events: the others still count
                    self._call("nvmlDeviceRegisterEvents", self._h(i), XID_CRITICAL_ERROR_EVENT, events)
            self._events = events
            return []
        out: list[tuple[int, int]] = []
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    return out  # nothing more pending
                raise NvmlCallError(f"nvmlEventSetWait_v2: {exc}") from exc
            index = int(self._call("nvmlDeviceGetIndex", data.device))
            out.append((index, int(data.eventData)))

    def close(self) -> None:
        """Free the Xid event set (NVML itself is shut down by :func:`close_nvml`)."""
        if self._events is not None:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlEventSetFree(self._events)
            self._events = None


def open_nvml() -> tuple[NvmlBackend | None, str | None]:
    """Initialise NVML if it can be.

    Returns:
        ``(backend, None)`` when NVML is up, else ``(None, reason)``: nvidia-ml-py missing, the NVML
        shared library missing (no driver installed), or the driver not loaded.
    """
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    except OSError as exc:  # a broken libnvidia-ml.so can fail to load below the NVMLError layer
        return None, f"NVML unavailable: {exc}"
    return PynvmlBackend(pynvml), None


def close_nvml(backend: NvmlBackend | None) -> None:
    """Shut NVML down after a probe (a no-op for fakes and for None)."""
    if isinstance(backend, PynvmlBackend):
        backend.close()
        with contextlib.suppress(backend._nv.NVMLError):
            backend._nv.nvmlShutdown()
