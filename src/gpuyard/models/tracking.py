"""Moved to :mod:`gpuyard.tracking.store`; named here for ``benchmarks/tracking.py`` until it moves."""

from gpuyard.tracking.store import DbTracker, start_run

__all__ = ["DbTracker", "start_run"]
