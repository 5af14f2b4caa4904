"""MIG in the inventory: NVIDIA's profile table, fake GPUs in MIG mode, and read-only NVML queries."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gpuyard.errors import ConfigError
from gpuyard.hardware.fake import set_mig
from gpuyard.hardware.mig import PROFILES, check_layout, mig_model, profile_from_name, profiles_of
from gpuyard.hardware.nvml import MigDevice, PynvmlBackend

pytestmark = pytest.mark.unit


def test_profile_table_matches_the_user_guide_geometry() -> None:
    # Every model: 1g.* fits 7 times at most, 7g.* is the whole GPU; the memory in the name follows the
    # memory slices (a slice is 1/8 of 40 or 80 GB, 5 or 10 GB).
    for model in ("A100-40GB", "A100-80GB", "H100-80GB"):
        ps = {p.name: p for p in profiles_of(model)}
        whole = max(ps.values(), key=lambda p: p.compute)
        assert (whole.compute, whole.memory, whole.max_count) == (7, 8, 1)
        slice_gb = int(model.split("-")[1].removesuffix("GB")) // 8
        assert all(p.memory_gb == p.memory * slice_gb for p in ps.values())
    assert PROFILES[("A100-40GB", "1g.5gb")].max_count == 7
    assert PROFILES[("H100-80GB", "1g.10gb")].max_count == 7
    assert PROFILES[("A100-80GB", "3g.40gb")].max_count == 2


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA L40S", None),
        ("NVIDIA H100 NVL", None),
    ],
)
def test_mig_model_of_nvml_names(name: str, model: str | None) -> None:
    assert mig_model(name) == model


def test_layouts_a_gpu_cannot_hold_are_refused() -> None:
    check_layout("A100-40GB", ["3g.20gb", "2g.10gb", "1g.10gb"])  # 6 compute, 8 memory slices: fits
    with pytest.raises(ValueError, match=r"at most 1 4g\.40gb"):
        check_layout("H100-80GB", ["4g.40gb", "4g.40gb"])
    with pytest.raises(ValueError, match="9/8 memory"):
        check_layout("H100-80GB", ["3g.40gb", "3g.40gb", "1g.10gb"])
    with pytest.raises(ValueError, match="not a A100-80GB MIG profile"):
        check_layout("A100-80GB", ["1g.5gb"])
    assert profile_from_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb"
    assert profile_from_name("NVIDIA H100 80GB HBM3") is None


def test_fake_gpus_in_mig_mode_show_their_slices(
    description: Callable[[str], dict[str, Any]], probe_description: Callable[..., Any]
) -> None:
    desc = description("h100_hgx")
    uuids = set_mig(desc, 3, ["3g.40gb", "3g.40gb"])
    assert len(set(uuids)) == 2 and all(u.startswith("MIG-") for u in uuids)
    accels = probe_description(desc).to_dict()["node"]["accelerators"]
    mig = accels[3]["mig"]
    assert mig["enabled"] is True and [d["profile"] for d in mig["devices"]] == ["3g.40gb", "3g.40gb"]
    assert mig["pending"] is True and accels[3]["health"] == "pass"  # in MIG mode, no change waiting
    assert [d["uuid"] for d in mig["devices"]] == uuids
    assert mig["devices"][0]["memory_bytes"] == accels[3]["memory_bytes"] // 2
    assert accels[0]["mig"] == {"enabled": False, "pending": False}  # no devices key outside MIG mode
    with pytest.raises(ConfigError, match=r"GPU 3: a H100-80GB holds at most 1 7g\.80gb"):
        set_mig(desc, 3, ["7g.80gb", "7g.80gb"])
    l40s = description("l40s_pcie")
    with pytest.raises(ConfigError, match="has no MIG profiles"):
        set_mig(l40s, 0, ["1g.10gb"])


class _StandIn:
    """A pynvml with the read-only MIG calls; records every call so the test can see none writes."""

    class NVMLError(Exception):
        value = 6  # NVML_ERROR_NOT_FOUND

    NVML_ERROR_NOT_SUPPORTED = 3

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.migs = {
            0: ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "MIG-aaa"),
            2: ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG-ccc"),
        }

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    def _log(self, name: str) -> None:
        self.calls.append(name)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        self._log("nvmlDeviceGetHandleByIndex")
        return ("gpu", i)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        self._log("nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, k: int) -> Any:
        self._log("nvmlDeviceGetMigDeviceHandleByIndex")
        if k not in self.migs:
            raise self.NVMLError("Not Found")
        return ("mig", k)

    def nvmlDeviceGetName(self, h: Any) -> str:
        self._log("nvmlDeviceGetName")
        return self.migs[h[1]][0]

    def nvmlDeviceGetUUID(self, h: Any) -> bytes:
        self._log("nvmlDeviceGetUUID")
        return self.migs[h[1]][1].encode()

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        self._log("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=20 * 2**30 if h[1] == 0 else 5 * 2**30, used=0)


def test_pynvml_backend_lists_mig_devices_with_read_only_calls() -> None:
    nv = _StandIn()
    devices = PynvmlBackend(nv).mig_devices(0)
    assert devices == [
        MigDevice(0, "MIG-aaa", "3g.20gb", 20 * 2**30),
        MigDevice(2, "MIG-ccc", "1g.5gb", 5 * 2**30),
    ]
    # Only getters: nothing creates, destroys or changes a MIG instance or the MIG mode.
    assert nv.calls and all(c.startswith("nvmlDeviceGet") for c in nv.calls)
