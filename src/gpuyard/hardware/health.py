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

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from gpuyard.hardware.inventory import Health, HealthReason
from gpuyard.hardware.nvml import (
    CLOCK_EVENT_REASONS,
    NVLINK_ERROR_COUNTERS,
    EccCounts,
    HealthNvmlBackend,
    NvmlBackend,
    NvmlCallError,
    RemappedRows,
    RetiredPages,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

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


# -- the periodic node check ----------------------------------------------------------------------
#
# The inventory grades a GPU once, at probe time. The node health check (run by the scheduler's
# health monitor, :class:`gpuyard.scheduler.nodes.NodeHealthMonitor`) reads the same NVML signals
# every ``interval_s``, plus what only shows over time: Xid errors (NVML delivers them as events) and
# NVLink error counters, and, on GPUs no job holds, a short GEMM and memory self-test
# (:mod:`gpuyard.hardware.selftest`). Its verdict per node is the worst GPU's: fail, warn or pass.

# Xid errors by what they say about the node. From NVIDIA's Xid catalog ("XID Errors", r555 and
# later) and its GPU debug guidelines: 48 double-bit ECC, 62/119/120 internal micro-controller or GSP
# failures, 64 ECC page retirement or row remap failure, 74 NVLink error, 79 GPU has fallen off the
# bus, 95 uncontained ECC error, 140 unrecovered ECC error: each asks for a GPU reset or a node
# reboot, so they fail the GPU. 61, 63, 92 and 94 (micro-controller breakpoint, a page retirement or
# row remap event, a high single-bit ECC rate, a contained ECC error) are watched. 13, 31, 43, 45,
# 68 and 69 are most often the application's own fault (illegal address, a killed process): they
# are recorded but not held against the node. Any other Xid warns.
XID_FAIL: frozenset[int] = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
XID_WARN: frozenset[int] = frozenset({61, 63, 92, 94})
XID_APPLICATION: frozenset[int] = frozenset({13, 31, 43, 45, 68, 69})

CHECKS = ("nvml", "xid", "nvlink_errors", "selftest")


@dataclass(frozen=True)
class NodeCheckConfig:
    """What the periodic node health check runs, how often, and the limits it applies.

    Attributes:
        interval_s: seconds between checks of the node.
        checks: which of :data:`CHECKS` run: ``nvml`` (ECC, retired pages and remapped rows,
            throttling, temperature, PCIe width, NVLinks down: the rules of :func:`assess`), ``xid``
            (Xid error events), ``nvlink_errors`` (data-link error counters), ``selftest`` (GEMM and
            memory self-test on GPUs no job holds).
        selftest_interval_s: seconds between self-tests of one GPU (they hold it a few seconds).
        selftest_size: the GEMM is ``size x size`` in FP32 (TF32 off).
        selftest_memory_mb: MiB written and read back by the memory test.
        selftest_timeout_s: a self-test not done by then fails the GPU (a hung GPU).
        gemm_rel_err_fail: the GEMM's largest error against an FP64 reference, relative to the
            reference's largest value, above which the GPU fails (FP32 with K=4096 stays near 1e-6).
        gemm_min_tflops: warn when the GEMM runs slower than this (None: not checked; the right
            figure depends on the GPU, e.g. about 50 for an H100 SXM in FP32).
        nvlink_errors_warn: warn when one GPU's NVLink replay + recovery + CRC errors, summed over its
            links, grow by this many between two checks.
        xid_fail / xid_warn: Xids that fail or warn a GPU (the defaults are explained above).
        drain_on_fail: a failing node is drained at once (its preemptible jobs move off); when
            False it is only marked degraded and an admin decides.
        thresholds: the limits of the NVML rules.
        remote_timeout_s: on a Ray cluster, how long the server waits for a node's check (each node's
            runs on it), on top of ``selftest_timeout_s`` per GPU when self-tests may run; a node that
            has not answered by then is recorded degraded.
    """

    interval_s: float = 60.0
    checks: tuple[str, ...] = CHECKS
    selftest_interval_s: float = 3600.0
    selftest_size: int = 4096
    selftest_memory_mb: int = 512
    selftest_timeout_s: float = 120.0
    gemm_rel_err_fail: float = 1e-3
    gemm_min_tflops: float | None = None
    nvlink_errors_warn: int = 100
    xid_fail: frozenset[int] = XID_FAIL
    xid_warn: frozenset[int] = XID_WARN
    drain_on_fail: bool = True
    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    remote_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        from gpuyard.errors import ConfigError

        unknown = sorted(set(self.checks) - set(CHECKS))
        if unknown:
            raise ConfigError(f"health checks {unknown} are unknown; known: {', '.join(CHECKS)}")
        if (
            self.interval_s <= 0
            or self.selftest_interval_s <= 0
            or self.selftest_timeout_s <= 0
            or self.remote_timeout_s <= 0
        ):
            raise ConfigError("health check intervals and timeouts must be > 0 seconds")
        if self.selftest_size < 1 or self.selftest_memory_mb < 0:
            raise ConfigError("selftest_size must be >= 1 and selftest_memory_mb >= 0")


def load_check_config(data: dict[str, object]) -> NodeCheckConfig:
    """A :class:`NodeCheckConfig` from a mapping (a YAML file's ``health:`` section): the field names
    above, ``thresholds`` a mapping of :class:`HealthThresholds` fields, Xid sets as lists.

    Raises:
        ConfigError: an unknown key or a bad value, named.
    """
    from dataclasses import fields

    from gpuyard.errors import ConfigError

    names = {f.name for f in fields(NodeCheckConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"health config: unknown keys {unknown}; known: {', '.join(sorted(names))}")
    values: dict[str, object] = dict(data)
    try:
        if "thresholds" in values:
            values["thresholds"] = HealthThresholds(**dict(values["thresholds"]))  # type: ignore[call-overload]
        for key in ("xid_fail", "xid_warn"):
            if key in values:
                values[key] = frozenset(int(x) for x in values[key])  # type: ignore[attr-defined]
        if "checks" in values:
            values["checks"] = tuple(str(c) for c in values["checks"])  # type: ignore[attr-defined]
        return NodeCheckConfig(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"health config: {exc}") from exc


@dataclass(frozen=True)
class SelfTestResult:
    """One GPU's self-test: ``ok`` None when it could not run (no torch/CUDA: not held against the GPU)."""

    ok: bool | None
    seconds: float = 0.0
    gemm_tflops: float | None = None
    gemm_rel_err: float | None = None
    gemm_repeat_mismatches: int | None = None
    memory_errors: int | None = None
    error: str = ""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {k: v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class NodeCheck:
    """One run of the node health check: the verdict (``fail``/``warn``/``pass``), each GPU's health,
    and what was measured (Xids seen, NVLink error counts, self-tests)."""

    verdict: str
    gpus: dict[int, Health]
    xids: tuple[tuple[int, int], ...] = ()
    nvlink_errors: dict[int, int] = field(default_factory=dict)
    selftests: dict[int, SelfTestResult] = field(default_factory=dict)
    note: str = ""

    @property
    def reasons(self) -> list[str]:
        """``GPU i: message`` for every warn and fail reason, fail first."""
        out = [
            (0 if r.level == "fail" else 1, f"GPU {i}: {r.message}")
            for i, h in sorted(self.gpus.items())
            for r in h.reasons
        ]
        return [text for _, text in sorted(out, key=lambda x: x[0])]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (stored as the node's last check)."""
        return {
            "verdict": self.verdict,
            "gpus": {
                str(i): {"status": h.status, "reasons": h.reasons_dicts()}
                for i, h in sorted(self.gpus.items())
            },
            "xids": [list(x) for x in self.xids],
            "nvlink_errors": {str(k): v for k, v in self.nvlink_errors.items()},
            "selftests": {str(k): v.to_dict() for k, v in self.selftests.items()},
            "note": self.note,
        }


def _get(fn: Callable[..., T], *args: object) -> T | None:
    try:
        return fn(*args)
    except NvmlCallError:
        return None


def gpu_signals(nv: NvmlBackend, i: int) -> GpuSignals:
    """What :func:`assess` reads about GPU ``i``, through NVML; a call NVML refuses leaves its field out."""
    name = _get(nv.name, i)
    if name is None and _get(nv.uuid, i) is None:
        try:
            nv.name(i)
        except NvmlCallError as exc:
            return GpuSignals(reachable=False, unreachable_reason=f"NVML cannot query GPU {i}: {exc}")
    mask = _get(nv.clock_event_reasons, i)
    pcie = _get(nv.pcie_link, i)
    mig = _get(nv.mig_mode, i)
    active = inactive = 0
    for link in range(nv.nvlink_max_links()):
        up = _get(nv.nvlink_active, i, link)
        if up is None:
            break
        active, inactive = active + int(up), inactive + int(not up)
    return GpuSignals(
        ecc_enabled=_get(nv.ecc_enabled, i),
        ecc=_get(nv.ecc_counts, i),
        retired=_get(nv.retired_pages, i),
        remapped=_get(nv.remapped_rows, i),
        clock_events=decode_clock_events(mask) if mask is not None else (),
        temperature_c=_get(nv.temperature_c, i),
        slowdown_temperature_c=_get(nv.slowdown_temperature_c, i),
        pcie_width=pcie.width if pcie else None,
        pcie_max_width=pcie.max_width if pcie else None,
        nvlink_active=active,
        nvlink_inactive=inactive,
        mig_pending_change=bool(mig and mig[0] != mig[1]),
    )


def nvlink_error_total(nv: HealthNvmlBackend, i: int) -> int | None:
    """GPU ``i``'s NVLink data-link errors (replay, recovery, CRC), summed over its active links; None
    when it has no NVLink or the driver does not count them."""
    total, seen = 0, False
    for link in range(nv.nvlink_max_links()):
        up = _get(nv.nvlink_active, i, link)
        if up is None:
            break
        if not up:
            continue
        for counter in NVLINK_ERROR_COUNTERS:
            value = _get(nv.nvlink_error_counter, i, link, counter)
            if value is not None:
                total, seen = total + value, True
    return total if seen else None


def _xid_reason(xid: int, config: NodeCheckConfig) -> HealthReason | None:
    if xid in config.xid_fail:
        return HealthReason(
            "fail", f"xid_{xid}", f"Xid {xid}{_XID_NAMES.get(xid, '')}: reset the GPU or drain the node"
        )
    if xid in XID_APPLICATION and xid not in config.xid_warn:
        return None
    return HealthReason("warn", f"xid_{xid}", f"Xid {xid}{_XID_NAMES.get(xid, '')}")


_XID_NAMES = {
    48: " (double-bit ECC error)",
    61: " (internal micro-controller breakpoint)",
    62: " (internal micro-controller halt)",
    63: " (ECC page retirement or row remap recorded)",
    64: " (ECC page retirement or row remap failed)",
    74: " (NVLink error)",
    79: " (GPU has fallen off the bus)",
    92: " (high single-bit ECC error rate)",
    94: " (contained ECC error)",
    95: " (uncontained ECC error)",
    119: " (GSP RPC timeout)",
    120: " (GSP error)",
    140: " (unrecovered ECC error)",
}


def _selftest_reasons(r: SelfTestResult, config: NodeCheckConfig) -> list[HealthReason]:
    if r.ok is None:
        return []
    out: list[HealthReason] = []
    if not r.ok:
        out.append(HealthReason("fail", "selftest_failed", f"self-test failed: {r.error or 'no result'}"))
    if r.gemm_rel_err is not None and r.gemm_rel_err > config.gemm_rel_err_fail:
        out.append(
            HealthReason(
                "fail",
                "gemm_wrong",
                f"GEMM self-test off by {r.gemm_rel_err:.2g} of the FP64 reference "
                f"(fail above {config.gemm_rel_err_fail:g})",
            )
        )
    if r.gemm_repeat_mismatches:
        out.append(
            HealthReason(
                "fail",
                "gemm_unstable",
                f"the same GEMM twice gave {r.gemm_repeat_mismatches} different values",
            )
        )
    if r.memory_errors:
        out.append(
            HealthReason("fail", "memory_test", f"memory self-test read back {r.memory_errors} wrong words")
        )
    if config.gemm_min_tflops and r.gemm_tflops is not None and r.gemm_tflops < config.gemm_min_tflops:
        out.append(
            HealthReason(
                "warn",
                "gemm_slow",
                f"GEMM self-test at {r.gemm_tflops:.1f} TFLOP/s (warn below {config.gemm_min_tflops:g})",
            )
        )
    return out


def check_node(
    nv: HealthNvmlBackend,
    config: NodeCheckConfig | None = None,
    idle: frozenset[int] | set[int] = frozenset(),
    selftest: Callable[[int], SelfTestResult] | None = None,
    nvlink_before: dict[int, int] | None = None,
) -> NodeCheck:
    """Run the node health check once.

    Args:
        nv: the node's NVML (kept open between checks: Xid events arrive on it).
        config: which checks and limits (default :class:`NodeCheckConfig`).
        idle: GPUs no job holds now: only these are self-tested.
        selftest: runs the self-test of one GPU (default: none is run).
        nvlink_before: each GPU's NVLink error total at the previous check (the warning is on the
            growth; the first check only records the totals).

    Returns:
        The verdict and what was seen. NVML that cannot count devices gives verdict ``pass`` with a
        note (a node without NVML is not held to it).
    """
    config = config or NodeCheckConfig()
    try:
        count = nv.device_count()
    except NvmlCallError as exc:
        return NodeCheck("pass", {}, note=f"NVML unavailable: {exc}")
    extra: dict[int, list[HealthReason]] = {i: [] for i in range(count)}
    xids: list[tuple[int, int]] = []
    if "xid" in config.checks:
        try:
            xids = list(nv.xid_events())
        except NvmlCallError as exc:
            log.warning("Xid events unavailable: %s", exc)
        for gpu, xid in xids:
            reason = _xid_reason(xid, config)
            if reason is not None and gpu in extra:
                extra[gpu].append(reason)
    nvlink: dict[int, int] = {}
    if "nvlink_errors" in config.checks:
        for i in range(count):
            total = nvlink_error_total(nv, i)
            if total is None:
                continue
            nvlink[i] = total
            grew = total - (nvlink_before or {}).get(i, total)
            if grew >= config.nvlink_errors_warn:
                extra[i].append(
                    HealthReason(
                        "warn",
                        "nvlink_errors",
                        f"{grew} NVLink replay/recovery/CRC errors since the last check "
                        f"(warn at {config.nvlink_errors_warn})",
                    )
                )
    tests: dict[int, SelfTestResult] = {}
    if "selftest" in config.checks and selftest is not None:
        for i in sorted(set(idle) & set(range(count))):
            tests[i] = selftest(i)
            extra[i].extend(_selftest_reasons(tests[i], config))
    gpus: dict[int, Health] = {}
    for i in range(count):
        if "nvml" in config.checks:
            signals = gpu_signals(nv, i)
        else:
            signals = GpuSignals()
        gpus[i] = assess(replace(signals, extra=tuple(extra[i])), config.thresholds)
    statuses = {h.status for h in gpus.values()}
    verdict = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
    return NodeCheck(verdict, gpus, tuple(xids), nvlink, tests)
