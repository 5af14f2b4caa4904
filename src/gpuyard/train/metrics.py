"""What the trainer measures besides the loss: device statistics, MFU and the progress line.

Where the measurements go (metrics.jsonl, the state store) is :mod:`gpuyard.tracking`.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "DeviceStats",
    "Progress",
    "catalog_peak_tflops",
    "model_flops_utilization",
]


class DeviceStats:
    """GPU memory (torch) and utilization (NVML) for the local device; empty on CPU.

    Read at most once per ``every_s`` seconds: NVML's utilization is itself an average over the
    driver's sample period (1/6 s to 1 s by product), and reading it every step cost a launch-bound
    step on an H200 about 1 ms of host time (BENCHMARKS.md, train overhead). The memory peak spans
    every step since the previous reading, so a step between readings is not lost from it.
    """

    def __init__(self, device: Any, every_s: float = 1.0) -> None:
        import time

        import torch

        self._torch = torch
        self._device = device
        self._clock = time.monotonic
        self._every_s = every_s
        self._due = float("-inf")
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
        """Current readings: gpu_mem_gb (peak since the last reading), gpu_util (%); empty on a CPU
        and when the last reading is under ``every_s`` old (the first call always reads)."""
        if getattr(self._device, "type", "cpu") != "cuda":
            return {}
        now = self._clock()
        if now < self._due:
            return {}
        self._due = now + self._every_s
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
    """A rich progress bar for interactive runs on rank 0; with ``lines`` instead (rank 0 when stdout
    is not a terminal: a job's log, a pipeline stage), a plain line at the first step and then at most
    every ``every_s`` seconds, so a job's log shows the run moving without a line per step."""

    def __init__(self, total: int | None, enabled: bool, lines: bool = False, every_s: float = 10.0) -> None:
        import time

        self._bar = None
        self._total = total
        self._lines, self._every_s, self._clock = lines and not enabled, every_s, time.monotonic
        self._next_line = 0.0
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

    def due(self) -> bool:
        """Whether :meth:`update` would show its ``info`` now (the caller may skip building it)."""
        return self._bar is not None or (self._lines and self._clock() >= self._next_line)

    def update(self, step: int, info: str) -> None:
        """Move the bar to `step` and show `info` beside it (or print a line, when one is due)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif self._lines and info and self._clock() >= self._next_line:
            self._next_line = self._clock() + self._every_s
            of = f"/{self._total}" if self._total else ""
            # stderr, as "gpuyard ...": the launcher passes such lines to the terminal (and train.log),
            # and stdout stays for --json.
            print(f"gpuyard train: step {step}{of}: {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop drawing."""
        if self._bar is not None:
            self._bar.stop()
