"""PynvmlBackend's calls for the periodic health check (Xid events, NVLink error counters), driven by
the stand-in ``pynvml`` of test_nvml_wrapper."""

from __future__ import annotations

import types
from typing import Any

import pytest

from gpuyard.hardware.health import check_node
from gpuyard.hardware.nvml import XID_CRITICAL_ERROR_EVENT, NvmlCallError, PynvmlBackend

from .test_nvml_wrapper import _NVMLError, fake_pynvml

pytestmark = pytest.mark.unit

TIMEOUT = 10


def _with_events(m: types.ModuleType, pending: list[tuple[int, int]]) -> types.ModuleType:
    m.NVML_ERROR_TIMEOUT = TIMEOUT
    m.registered = []

    def wait(event_set: Any, timeout_ms: int) -> Any:
        assert event_set == "set" and timeout_ms == 0  # never blocks the check
        if not pending:
            raise _NVMLError(TIMEOUT)
        handle, xid = pending.pop(0)
        return types.SimpleNamespace(device=handle, eventData=xid)

    def counter(h: int, link: int, kind: int) -> int:
        if link >= 12:
            raise _NVMLError(2)
        return 3 if (h, link, kind) == (1, 4, 0) else 0

    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlDeviceRegisterEvents = lambda h, mask, s: m.registered.append((h, mask))
    m.nvmlEventSetWait_v2 = wait
    m.nvmlEventSetFree = lambda s: m.calls.append("free")
    m.nvmlDeviceGetIndex = lambda h: h
    m.nvmlDeviceGetNvLinkErrorCounter = counter
    return m


def test_xid_events_register_once_then_drain_without_blocking() -> None:
    pending: list[tuple[int, int]] = []
    m = _with_events(fake_pynvml(gpus=2), pending)
    nv = PynvmlBackend(m)
    assert nv.xid_events() == []  # the first call registers every GPU
    assert m.registered == [(0, XID_CRITICAL_ERROR_EVENT), (1, XID_CRITICAL_ERROR_EVENT)]
    pending.extend([(1, 79), (0, 48)])
    assert nv.xid_events() == [(1, 79), (0, 48)]
    assert nv.xid_events() == []
    nv.close()
    assert m.calls[-1] == "free"


def test_event_wait_errors_other_than_timeout_are_call_errors() -> None:
    m = _with_events(fake_pynvml(gpus=1), [])
    nv = PynvmlBackend(m)
    nv.xid_events()

    def broken(*_: Any) -> Any:
        raise _NVMLError(999)

    m.nvmlEventSetWait_v2 = broken
    with pytest.raises(NvmlCallError, match="nvmlEventSetWait_v2"):
        nv.xid_events()


def test_nvlink_counters_are_summed_over_active_links() -> None:
    m = _with_events(fake_pynvml(gpus=2), [])
    nv = PynvmlBackend(m)
    assert nv.nvlink_error_counter(1, 4, 0) == 3
    check = check_node(nv)
    assert check.nvlink_errors == {0: 0, 1: 3}
