"""The trainer's device statistics: read at most once per interval, the memory peak spanning the steps
between readings (a reading every step cost a launch-bound GPU step ~0.16 ms of host time)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gpuyard.train.metrics import DeviceStats


class _FakeCuda:
    """torch.cuda's peak counter: the peak since the last reset."""

    def __init__(self) -> None:
        self.peak, self.resets = 0, 0

    def allocate(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)

    def max_memory_allocated(self, device: object) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: object) -> None:
        self.peak, self.resets = 0, self.resets + 1


def _stats(every_s: float) -> tuple[DeviceStats, _FakeCuda, list[float]]:
    stats = DeviceStats(torch.device("cpu"), every_s=every_s)
    cuda, now = _FakeCuda(), [100.0]
    stats._device = SimpleNamespace(type="cuda")  # a GPU as DeviceStats sees one, without NVML
    stats._torch = SimpleNamespace(cuda=cuda)  # type: ignore[assignment]
    stats._nvml_handle = None
    stats._clock = lambda: now[0]
    return stats, cuda, now


def test_reads_once_per_interval_and_the_peak_spans_the_steps_between() -> None:
    stats, cuda, now = _stats(every_s=1.0)
    cuda.allocate(2**30)
    assert stats.sample() == {"gpu_mem_gb": 1.0}  # the first call always reads
    cuda.allocate(3 * 2**30)  # a step between readings reaches 3 GiB
    now[0] += 0.5
    assert stats.sample() == {}  # too soon: nothing read, the peak not reset
    assert cuda.resets == 1
    cuda.allocate(2 * 2**30)
    now[0] += 0.5
    assert stats.sample() == {"gpu_mem_gb": 3.0}  # the skipped step's peak is in this reading
    assert cuda.resets == 2


def test_interval_zero_reads_every_call_and_a_cpu_reads_nothing() -> None:
    stats, cuda, _ = _stats(every_s=0.0)
    cuda.allocate(2**29)
    assert stats.sample() == {"gpu_mem_gb": 0.5}
    assert stats.sample() == {"gpu_mem_gb": 0.0}
    assert DeviceStats(torch.device("cpu")).sample() == {}
