"""/stats figures: throughput is requests over the time they were counted in, percentiles over the window."""

from __future__ import annotations

import pytest

from gpuyard.serve import monitor

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(monitor.time, "monotonic", c)
    return c


def test_throughput_counts_over_the_window_or_the_uptime(clock: _Clock) -> None:
    m = monitor.ServeMetrics("m", 1)
    clock.t += 10.0
    m.observe_ok(0.002)  # one request 10 s after the start: 0.1 req/s, not one over a few ms
    assert m.stats()["throughput_rps"] == pytest.approx(0.1)
    for _ in range(300):  # a burst of 300 within the same second
        m.observe_ok(0.001)
    clock.t += 50.0  # read later: 301 requests in the first 60 s of uptime
    s = m.stats()
    assert s["requests"] == 301 and s["throughput_rps"] == pytest.approx(301 / 60, rel=1e-3)
    clock.t += 30.0  # all 301 are 80 s old now: out of the window
    assert m.stats()["requests"] == 0 and m.stats()["throughput_rps"] == 0.0


def test_a_full_buffer_counts_from_its_oldest_entry(clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monitor, "WINDOW_MAX", 100)
    m = monitor.ServeMetrics("m", 1)
    clock.t += 30.0
    for _ in range(200):  # 200 requests over 2 s; the buffer keeps the newest 100 (the last second)
        m.observe_ok(0.001)
        clock.t += 0.01
    s = m.stats()
    assert s["requests"] == 100 and s["throughput_rps"] == pytest.approx(100, rel=0.02)
