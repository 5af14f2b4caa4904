"""GPU health: failing GPUs are marked fail, degraded ones warn, each with its reason."""

from __future__ import annotations

from typing import Any

import pytest

from gpuyard.hardware.health import GpuSignals, HealthThresholds, assess, decode_clock_events
from gpuyard.hardware.nvml import EccCounts, RemappedRows, RetiredPages

pytestmark = pytest.mark.unit


def _gpu3(**fields: Any):
    def mutate(desc: dict) -> None:
        desc["nvml"]["gpus"][3].update(fields)

    return mutate


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        (
            {
                "ecc": {
                    "volatile_corrected": 3,
                    "volatile_uncorrected": 2,
                    "aggregate_corrected": 9,
                    "aggregate_uncorrected": 2,
                }
            },
            "ecc_uncorrectable",
        ),
        (
            {"remapped_rows": {"corrected": 0, "uncorrected": 1, "pending": True, "failed": False}},
            "row_remap_pending",
        ),
        (
            {"remapped_rows": {"corrected": 2, "uncorrected": 510, "pending": False, "failed": True}},
            "row_remap_failed",
        ),
        ({"retired_pages": {"single_bit": 1, "double_bit": 1, "pending": True}}, "retired_pages_pending"),
        ({"retired_pages": {"single_bit": 30, "double_bit": 31, "pending": False}}, "retired_pages_limit"),
        ({"clock_event_reasons": 0x40 | 0x1}, "hw_thermal_slowdown"),
        ({"clock_event_reasons": 0x80}, "hw_power_brake_slowdown"),
    ],
)
def test_failing_gpu_is_marked_fail(probe_fixture, fields: dict, code: str) -> None:
    inv = probe_fixture("h100_hgx", _gpu3(**fields))
    gpu = inv.accelerators[3]
    assert gpu.health.status == "fail"
    assert code in [r.code for r in gpu.health.reasons if r.level == "fail"]
    assert inv.health == "fail"
    assert all(a.health.status == "pass" for a in inv.accelerators if a.index != 3)
    doc = inv.to_dict()["node"]
    assert doc["health"] == "fail" and doc["accelerators"][3]["health"] == "fail"
    assert doc["accelerators"][3]["health_reasons"][0]["level"] == "fail"


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        (
            {
                "ecc": {
                    "volatile_corrected": 0,
                    "volatile_uncorrected": 0,
                    "aggregate_corrected": 0,
                    "aggregate_uncorrected": 4,
                }
            },
            "ecc_uncorrectable_history",
        ),
        (
            {
                "ecc": {
                    "volatile_corrected": 5000,
                    "volatile_uncorrected": 0,
                    "aggregate_corrected": 5000,
                    "aggregate_uncorrected": 0,
                }
            },
            "ecc_corrected",
        ),
        ({"ecc_enabled": False}, "ecc_disabled"),
        ({"clock_event_reasons": 0x20}, "sw_thermal_slowdown"),
        ({"clock_event_reasons": 0x4}, "sw_power_cap"),
        ({"temperature_c": 86}, "hot"),
        ({"pcie": {"gen": 5, "width": 8, "max_gen": 5, "max_width": 16}}, "pcie_degraded"),
        (
            {"nvlink": {"version": 6, "remote_kind": "switch", "peers": {"00000000:05:00.0": 4}, "down": 14}},
            "nvlink_down",
        ),
        ({"mig_mode": {"current": False, "pending": True}}, "mig_pending"),
        (
            {"remapped_rows": {"corrected": 3, "uncorrected": 0, "pending": False, "failed": False}},
            "rows_remapped",
        ),
    ],
)
def test_degraded_gpu_warns(probe_fixture, fields: dict, code: str) -> None:
    inv = probe_fixture("h100_hgx", _gpu3(**fields))
    gpu = inv.accelerators[3]
    assert gpu.health.status == "warn", gpu.health
    assert [r.code for r in gpu.health.reasons] == [code]
    assert inv.health == "warn"


def test_idle_gen1_link_is_not_a_fault(probe_fixture) -> None:
    # Idle GPUs drop their PCIe generation to save power; only a narrower link is a fault.
    inv = probe_fixture("l40s_pcie", _gpu3(pcie={"gen": 1, "width": 16, "max_gen": 4, "max_width": 16}))
    assert inv.accelerators[3].health.status == "pass"


def test_temperature_threshold_without_driver_limit() -> None:
    t = HealthThresholds()
    assert assess(GpuSignals(temperature_c=84)).status == "pass"
    assert assess(GpuSignals(temperature_c=t.temperature_warn_c)).status == "warn"
    assert assess(GpuSignals(temperature_c=80, slowdown_temperature_c=84)).status == "warn"


def test_fail_reasons_come_first_and_thresholds_apply() -> None:
    signals = GpuSignals(
        ecc=EccCounts(2000, 1, 2000, 1),
        retired=RetiredPages(single_bit=2, double_bit=0, pending=False),
        remapped=RemappedRows(0, 0, False, False),
        clock_events=("sw_power_cap",),
    )
    health = assess(signals)
    assert health.status == "fail"
    levels = [r.level for r in health.reasons]
    assert levels == sorted(levels, key=lambda lvl: lvl != "fail") and levels[0] == "fail"
    relaxed = assess(GpuSignals(retired=RetiredPages(10, 0, False)), HealthThresholds(retired_pages_fail=5))
    assert relaxed.status == "fail" and relaxed.reasons[0].code == "retired_pages_limit"


def test_decode_clock_events() -> None:
    assert decode_clock_events(0) == ()
    assert decode_clock_events(0x1 | 0x4 | 0x40) == ("gpu_idle", "sw_power_cap", "hw_thermal_slowdown")
