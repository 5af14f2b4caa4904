"""PynvmlBackend, the real seam, driven by a stand-in ``pynvml`` module shaped like nvidia-ml-py."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpuyard.hardware.nvml import NvmlCallError, PynvmlBackend, normalize_bus_id
from gpuyard.hardware.probe import probe_node
from gpuyard.hardware.sysfs import HostRoots

pytestmark = pytest.mark.unit

NOT_SUPPORTED = 3
SWITCHES = [f"00000000:{b:02X}:00.0" for b in (0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9)]


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NOT_SUPPORTED: "Not Supported", 2: "Invalid Argument"}.get(self.value, "Unknown Error")


def _unsupported(*_args: Any) -> Any:
    raise _NVMLError(NOT_SUPPORTED)


def fake_pynvml(gpus: int = 2) -> types.ModuleType:
    """An A100 HGX as nvidia-ml-py would present it: 12 NVLinks, 2 to each of 6 NVSwitches."""
    m = types.ModuleType("pynvml")
    ns = types.SimpleNamespace
    m.NVMLError = _NVMLError
    consts = {
        "NVML_ERROR_NOT_SUPPORTED": NOT_SUPPORTED,
        "NVML_FEATURE_ENABLED": 1,
        "NVML_TEMPERATURE_GPU": 0,
        "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
        "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
        "NVML_VOLATILE_ECC": 0,
        "NVML_AGGREGATE_ECC": 1,
        "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
        "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
        "NVML_NVLINK_MAX_LINKS": 18,
    }
    for k, v in consts.items():
        setattr(m, k, v)
    m.calls = []

    def link_check(h: int, link: int) -> None:
        if link >= 12:
            raise _NVMLError(2)

    def state(h: int, link: int) -> int:
        link_check(h, link)
        return 1

    def remote(h: int, link: int) -> Any:
        link_check(h, link)
        return ns(busId=SWITCHES[link // 2].encode())

    def total_ecc(h: int, kind: int, counter: int) -> int:
        if counter == 1:
            raise _NVMLError(NOT_SUPPORTED)
        return 7 if kind == 0 else 0

    functions = {
        "nvmlInit": lambda: m.calls.append("init"),
        "nvmlShutdown": lambda: m.calls.append("shutdown"),
        "nvmlSystemGetDriverVersion": lambda: "535.104.05",
        "nvmlSystemGetCudaDriverVersion": lambda: 12020,
        "nvmlDeviceGetCount": lambda: gpus,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: b"NVIDIA A100-SXM4-80GB",
        "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd",
        "nvmlDeviceGetPciInfo": lambda h: ns(busId=f"00000000:{0x07 + h * 8:02X}:00.0".encode()),
        "nvmlDeviceGetMemoryInfo": lambda h: ns(total=85899345920, free=85000000000, used=899345920),
        "nvmlDeviceGetCudaComputeCapability": lambda h: (8, 0),
        "nvmlDeviceGetPowerUsage": lambda h: 61_000,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 400_000,
        "nvmlDeviceGetTemperature": lambda h, sensor: 33,
        "nvmlDeviceGetTemperatureThreshold": _unsupported,
        "nvmlDeviceGetUtilizationRates": lambda h: ns(gpu=5, memory=1),
        "nvmlDeviceGetEccMode": lambda h: (1, 1),
        "nvmlDeviceGetTotalEccErrors": total_ecc,
        "nvmlDeviceGetRetiredPages": _unsupported,
        "nvmlDeviceGetRemappedRows": lambda h: (1, 0, 0, 0),
        # No nvmlDeviceGetCurrentClocksEventReasons: an nvidia-ml-py older than r535.
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: 0x1,
        "nvmlDeviceGetMigMode": lambda h: (1, 1),
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 4,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 4,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetCpuAffinity": lambda h, words: [0b1111 << (4 * h)],
        "nvmlDeviceGetNvLinkState": state,
        "nvmlDeviceGetNvLinkVersion": lambda h, link: 5,  # what an A100 answers: NVLink 3.1
        "nvmlDeviceGetNvLinkRemotePciInfo": remote,
        "nvmlDeviceGetNvLinkRemoteDeviceType": lambda h, link: 2,
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: 20 if {a, b} == {0, 1} else 70,
    }
    for name, fn in functions.items():
        setattr(m, name, fn)
    return m


def test_wrapper_maps_every_call(tmp_path: Path) -> None:
    nv = PynvmlBackend(fake_pynvml())
    inv = probe_node(nv, roots=HostRoots.under(tmp_path), frameworks=False, hostname="a100")
    g = inv.to_dict()["node"]["accelerators"][1]
    assert g["name"] == "NVIDIA A100-SXM4-80GB" and g["uuid"].startswith("GPU-00000001")
    assert g["bus_id"] == "0000:0f:00.0" and g["compute_capability"] == "8.0"
    assert g["memory_bytes"] == 85899345920 and g["memory_used_bytes"] == 899345920
    assert g["power_w"] == 61.0 and g["power_limit_w"] == 400.0 and g["temperature_c"] == 33
    assert g["ecc"] == {
        "volatile_corrected": 7,
        "volatile_uncorrected": 0,
        "aggregate_corrected": None,
        "aggregate_uncorrected": None,
    }
    assert g["retired_pages"] is None and g["unavailable"]["retired_pages"] == "not supported"
    assert g["unavailable"]["slowdown_temperature_c"] == "not supported"
    assert g["remapped_rows"] == {"corrected": 1, "uncorrected": 0, "pending": False, "failed": False}
    assert g["clock_event_reasons"] == ["gpu_idle"] and g["mig"] == {"enabled": True, "pending": True}
    assert g["cpu_affinity"] == "4-7"
    assert (
        g["nvlink"]["version"] == "3.1"
        and g["nvlink"]["generation"] == 3
        and g["nvlink"]["active_links"] == 12
    )
    assert [p["links"] for p in g["nvlink"]["peers"]] == [2] * 6
    assert inv.topology.link("GPU0", "GPU1") == "NV12"
    # One remapped row (warn) on each GPU.
    assert [a.health.status for a in inv.accelerators] == ["warn", "warn"]
    assert inv.driver["driver_version"] == "535.104.05" and inv.driver["cuda_driver_version"] == "12.2"


def test_not_supported_is_flagged() -> None:
    nv = PynvmlBackend(fake_pynvml(gpus=3))
    assert nv.common_ancestor(0, 1) == "PXB"
    with pytest.raises(NvmlCallError, match="unknown level"):
        nv.common_ancestor(0, 2)
    with pytest.raises(NvmlCallError) as info:
        nv.retired_pages(0)
    assert info.value.not_supported
    with pytest.raises(NvmlCallError) as info:
        nv.nvlink_active(0, 12)
    assert not info.value.not_supported


def test_open_nvml_uses_the_installed_module_and_shuts_it_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    fake = fake_pynvml(gpus=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    inv = probe_node(roots=HostRoots.under(tmp_path), frameworks=False)
    assert len(inv.accelerators) == 1 and fake.calls == ["init", "shutdown"]


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:C4:00.0") == "0000:c4:00.0"
    assert normalize_bus_id(b"00000001:18:00.0") == "0001:18:00.0"
    assert normalize_bus_id("0000:18:00.0") == "0000:18:00.0"
