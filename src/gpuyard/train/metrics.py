"""The tracking interface the trainer reports through, its JSON-lines default, and device statistics.

The state-store tracker (``tracking: db``) is in :mod:`gpuyard.train.tracking`.
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
        doc = {"time": round(time.time(), 3), **{k: _clean(v) for k, v in doc.items()}}
        with self._lock:
            if not self._fh.closed:
                self._fh.write(json.dumps(doc) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        """Write a `params` event."""
        self._write({"event": "params", "params": params})

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Write a `metrics` event for `step`."""
        self._write({"event": "metrics", "step": step, **metrics})

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


class DeviceStats:
    """GPU memory (torch) and utilization (NVML) for the local device; empty on CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._nvml_handle = None
        if getattr(device, "type", "cpu") == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                index = device.index if device.index is not None else torch.cuda.current_device()
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._pynvml = pynvml
            except Exception:  # NVML missing (e.g. a container without the driver library): memory only
                self._nvml_handle = None

    def sample(self) -> dict[str, float]:
        """Current readings: gpu_mem_gb (peak since last sample), gpu_util (%)."""
        if getattr(self._device, "type", "cpu") != "cuda":
            return {}
        cuda = self._torch.cuda
        out = {"gpu_mem_gb": cuda.max_memory_allocated(self._device) / 2**30}
        cuda.reset_peak_memory_stats(self._device)
        if self._nvml_handle is not None:
            out["gpu_util"] = float(self._pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
        return out


def catalog_peak_tflops(device: Any, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a CUDA device from gpuyard's accelerator catalog (None: unknown or CPU)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    from gpuyard.errors import NotFoundError
    from gpuyard.hardware.catalog import match_spec

    spec = match_spec(torch.cuda.get_device_name(device))
    if spec is None:
        return None
    try:
        return spec.peak_tflops(dtype)
    except NotFoundError:
        return None


def model_flops_utilization(params: int, tokens_per_s: float, devices: int, peak_tflops: float) -> float:
    """MFU: achieved training FLOP/s over the peak, with 6 x params FLOPs per token (forward + backward).

    The 6N rule (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1) leaves
    out attention's sequence-length term, as PaLM's MFU definition does for short sequences.
    """
    return 6.0 * params * tokens_per_s / (devices * peak_tflops * 1e12)


class Progress:
    """A rich progress bar for interactive runs on rank 0; does nothing when stdout is not a terminal."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, info="")

    def update(self, step: int, info: str) -> None:
        """Move the bar to `step` and show `info` beside it."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        """Stop drawing."""
        if self._bar is not None:
            self._bar.stop()
