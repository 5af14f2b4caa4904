"""The tracking interface the trainer reports through, and its file trackers (``metrics.jsonl``).

A run folder's ``metrics.jsonl`` is the crash-safe record every training run keeps; the state store's
run (:mod:`gpuyard.tracking.store`) is added on top of it by :mod:`gpuyard.tracking.training`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """Where a run's parameters and per-step metrics go (model management plugs a database one in)."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Record the run's settings once (the resolved spec)."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record metrics for an optimizer step."""

    def finish(self, status: str) -> None:
        """Close the run with its final status (completed, preempted, diverged, ...)."""


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so a diverged step is still recorded and parseable.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlTracker:
    """Appends one JSON object per event to `<run_dir>/metrics.jsonl` (appending survives restarts)."""

    def __init__(self, run_dir: str | Path, filename: str = "metrics.jsonl") -> None:
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: a killed worker loses at most the line it was writing.
        self._fh = self.path.open("a", buffering=1)
        # The database tracker's thread writes its events here too: one line at a time.
        self._lock = threading.Lock()

    def _write(self, doc: dict[str, Any]) -> None:
        self._write_line({"time": round(time.time(), 3), **doc})

    def _write_line(self, doc: dict[str, Any]) -> None:
        try:  # every value finite: one pass (a step's line is written on the training thread)
            line = json.dumps(doc, allow_nan=False)
        except ValueError:
            line = json.dumps({k: _clean(v) for k, v in doc.items()})
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        """Write a `params` event."""
        self._write({"event": "params", "params": params})

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Write a `metrics` event for `step`."""
        self._write_line({"time": round(time.time(), 3), "event": "metrics", "step": step, **metrics})

    def log_event(self, event: str, **fields: Any) -> None:
        """Write a free-form event (resume, checkpoint, stop)."""
        self._write({"event": event, **fields})

    def finish(self, status: str) -> None:
        """Write a `finish` event and close the file."""
        if not self._fh.closed:
            self._write({"event": "finish", "status": status})
            with self._lock:
                self._fh.close()


class NullTracker:
    """Discards everything (ranks other than 0, benchmarks)."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Ignore."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Ignore."""

    def finish(self, status: str) -> None:
        """Ignore."""


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Load every event of `<run_dir>/metrics.jsonl` (a torn last line from a killed worker is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
