"""Health per GPU: pass / warn / fail with reasons, from NVML's error counters and throttle reasons.

``fail`` means "keep jobs off this GPU until someone acts" (reset, drain, RMA); ``warn`` means "usable,
but slower or degrading: look at it". The scheduler places nothing on ``fail``. Thresholds are in
:class:`HealthThresholds`; the rules and why:

fail
  * volatile uncorrectable ECC errors > 0: since the driver loaded, memory returned bad data; the
    process that saw it was killed and NVIDIA asks for a GPU reset (Xid 48/63/64/94/95).
  * a page retirement or row remap is pending: it only takes effect after a GPU reset.
  * row remapping failed: the bank has no spare rows left; NVIDIA's A100/H100 memory-error guide
    treats this as a board to replace.
  * retired pages >= ``retired_pages_fail`` (60): the dynamic page retirement table holds at most
    64 pages, so the board is close to unable to retire more.
  * hardware slowdown, hardware thermal slowdown or hardware power brake active: the board cut its
    clocks by half or more (overheating, a power-supply fault); a gang job would run at its pace.
  * the GPU cannot be queried at all (NVML answers "GPU is lost").

warn
  * uncorrectable ECC errors in the lifetime (aggregate) counter only: past trouble, now cleared.
  * volatile corrected ECC errors >= ``corrected_warn`` (1000): correctable, but a rising count
    precedes retirements.
  * any retired page or remapped row (below the fail limits).
  * ECC supported but switched off: memory errors would go unnoticed.
  * software thermal slowdown or software power cap active.
  * temperature within ``temperature_margin_c`` (5 C) of the slowdown threshold, or at least
    ``temperature_warn_c`` (85 C) when the driver does not report the threshold.
  * PCIe link narrower than its maximum (x8 of x16): a reseat/riser fault. Generation is not
    checked, because idle GPUs drop to Gen1 to save power.
  * some NVLinks down while others are up: less bandwidth to peers.
  * a MIG mode change is pending a reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuyard.hardware.inventory import Health, HealthReason
from gpuyard.hardware.nvml import CLOCK_EVENT_REASONS, EccCounts, RemappedRows, RetiredPages

FAIL_CLOCK_EVENTS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
WARN_CLOCK_EVENTS = ("sw_thermal_slowdown", "sw_power_cap")


@dataclass(frozen=True)
class HealthThresholds:
    """Limits behind the rules above (see the module docstring for the reasoning)."""

    retired_pages_fail: int = 60
    corrected_warn: int = 1000
    temperature_margin_c: int = 5
    temperature_warn_c: int = 85


@dataclass(frozen=True)
class GpuSignals:
    """What the health check reads about one GPU; None means NVML could not tell."""

    reachable: bool = True
    unreachable_reason: str = ""
    ecc_enabled: bool | None = None
    ecc: EccCounts | None = None
    retired: RetiredPages | None = None
    remapped: RemappedRows | None = None
    clock_events: tuple[str, ...] = ()
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    nvlink_active: int = 0
    nvlink_inactive: int = 0
    mig_pending_change: bool = False
    extra: tuple[HealthReason, ...] = field(default=())


def decode_clock_events(mask: int) -> tuple[str, ...]:
    """Names of the set bits of an nvmlClocksEventReasons mask, in bit order."""
    return tuple(name for bit, name in sorted(CLOCK_EVENT_REASONS.items()) if mask & bit)


def _memory_reasons(s: GpuSignals, t: HealthThresholds) -> list[HealthReason]:
    out: list[HealthReason] = []
    ecc = s.ecc
    if ecc is not None:
        if (ecc.volatile_uncorrected or 0) > 0:
            out.append(
                HealthReason(
                    "fail",
                    "ecc_uncorrectable",
                    f"{ecc.volatile_uncorrected} uncorrectable ECC "
                    "errors since the driver loaded; reset the GPU",
                )
            )
        elif (ecc.aggregate_uncorrected or 0) > 0:
            out.append(
                HealthReason(
                    "warn",
                    "ecc_uncorrectable_history",
                    f"{ecc.aggregate_uncorrected} uncorrectable ECC errors in the lifetime counter",
                )
            )
        if (ecc.volatile_corrected or 0) >= t.corrected_warn:
            out.append(
                HealthReason(
                    "warn",
                    "ecc_corrected",
                    f"{ecc.volatile_corrected} corrected ECC errors "
                    f"since the driver loaded (warn at {t.corrected_warn})",
                )
            )
    if s.ecc_enabled is False:
        out.append(HealthReason("warn", "ecc_disabled", "ECC is supported but disabled"))
    r = s.retired
    if r is not None:
        total = r.single_bit + r.double_bit
        if r.pending:
            out.append(
                HealthReason("fail", "retired_pages_pending", "a page retirement is pending; reset the GPU")
            )
        if total >= t.retired_pages_fail:
            out.append(
                HealthReason(
                    "fail",
                    "retired_pages_limit",
                    f"{total} retired pages (fail at {t.retired_pages_fail}; the table holds 64)",
                )
            )
        elif total > 0:
            out.append(
                HealthReason("warn", "retired_pages", f"{total} retired pages ({r.double_bit} double-bit)")
            )
    m = s.remapped
    if m is not None:
        if m.failed:
            out.append(HealthReason("fail", "row_remap_failed", "row remapping failed: no spare rows left"))
        if m.pending:
            out.append(HealthReason("fail", "row_remap_pending", "a row remap is pending; reset the GPU"))
        if (m.corrected + m.uncorrected) > 0 and not m.failed:
            out.append(
                HealthReason(
                    "warn",
                    "rows_remapped",
                    f"{m.corrected + m.uncorrected} rows remapped ({m.uncorrected} for uncorrectable errors)",
                )
            )
    return out


def _runtime_reasons(s: GpuSignals, t: HealthThresholds) -> list[HealthReason]:
    out: list[HealthReason] = []
    for name in s.clock_events:
        if name in FAIL_CLOCK_EVENTS:
            out.append(HealthReason("fail", name, f"clocks cut by {name.replace('_', ' ')}"))
        elif name in WARN_CLOCK_EVENTS:
            out.append(HealthReason("warn", name, f"clocks held down by {name.replace('_', ' ')}"))
    temp = s.temperature_c
    if temp is not None:
        limit = (
            (s.slowdown_temperature_c - t.temperature_margin_c)
            if s.slowdown_temperature_c
            else t.temperature_warn_c
        )
        if temp >= limit:
            out.append(HealthReason("warn", "hot", f"{temp} C (warn at {limit} C)"))
    if s.pcie_width and s.pcie_max_width and s.pcie_width < s.pcie_max_width:
        out.append(HealthReason("warn", "pcie_degraded", f"PCIe link x{s.pcie_width} of x{s.pcie_max_width}"))
    if s.nvlink_inactive and s.nvlink_active:
        out.append(
            HealthReason(
                "warn",
                "nvlink_down",
                f"{s.nvlink_inactive} of {s.nvlink_active + s.nvlink_inactive} NVLinks are down",
            )
        )
    if s.mig_pending_change:
        out.append(HealthReason("warn", "mig_pending", "a MIG mode change waits for a GPU reset"))
    return out


def assess(signals: GpuSignals, thresholds: HealthThresholds | None = None) -> Health:
    """Grade one GPU.

    Args:
        signals: its counters and state (missing ones are skipped, not held against it).
        thresholds: limits; the defaults are documented in this module.

    Returns:
        ``Health("fail"|"warn"|"pass", reasons)``, reasons ordered fail first.
    """
    t = thresholds or HealthThresholds()
    if not signals.reachable:
        reason = HealthReason(
            "fail", "unreachable", signals.unreachable_reason or "NVML cannot query this GPU"
        )
        return Health("fail", (reason,))
    reasons = [*_memory_reasons(signals, t), *_runtime_reasons(signals, t), *signals.extra]
    reasons.sort(key=lambda r: 0 if r.level == "fail" else 1)
    status = "fail" if any(r.level == "fail" for r in reasons) else "warn" if reasons else "pass"
    return Health(status, tuple(reasons))
