"""The load check of benchmarks/predict_measure.py (gpuyard.fabric.loadprobe): the compute-rate probe
and the rule that withholds a figure."""

from __future__ import annotations

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric import loadprobe as pm

pytestmark = pytest.mark.multiproc


def test_a_rate_off_the_calibrations_by_more_than_the_tolerance_withholds_the_figure() -> None:
    tol = pm.RATE_TOLERANCE
    assert not pm.changed(100.0, 100.0 * (1 + tol * 0.9), 100.0 * (1 - tol * 0.9))
    assert pm.changed(100.0, 100.0, 100.0 * (1 - tol * 1.1))  # slower after the run
    assert pm.changed(100.0, 100.0 * (1 + tol * 1.1), 100.0)  # faster before it (load went away)


def test_the_probe_measures_a_rank_in_its_own_process() -> None:
    probe = pm.RateProbe("cpu", 1)
    try:
        rate = probe.rate()
    finally:
        probe.close()
    # One single-thread GEMM loop of 256^3: at least 0.1 GFLOP/s on any machine that runs the suite.
    assert rate > 1e8


def test_the_probe_refuses_a_device_it_cannot_measure() -> None:
    with pytest.raises(ConfigError, match="cpu or cuda"):
        pm.RateProbe("tpu", 1)
