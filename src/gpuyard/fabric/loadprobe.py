"""How fast this machine computes right now: a short probe that tells when a measurement cannot be trusted.

A calibration taken while other work shares the machine predicts every later run too slow, or too fast
once the load goes away. ``benchmarks/predict_measure.py`` probes the compute rate right after its
calibration and before and after every run, and withholds the figure of a run whose rate moved by
more than :data:`RATE_TOLERANCE` (see docs/fabric.md, predict-then-measure).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor

from gpuyard.errors import ConfigError

# A run counts only when the compute rate before and after it is within this of the calibration's:
# the goal is a median error of 0.10, and a rate change of that size alone would move a prediction by
# as much. The probe's own spread on a quiet machine is about 2-3%.
RATE_TOLERANCE = 0.10
PROBE_WINDOW_S = 0.6  # each probe: every rank runs GEMMs for this long, at the same time


def _probe_init() -> None:
    import torch

    torch.set_num_threads(1)  # as a rank of `gpuyard train --nproc N>1` (torchrun's one thread per rank)


def _probe_rank(start_at: float, window_s: float) -> float:
    """FLOP/s of one core running fp32 GEMMs from ``start_at`` (wall clock) for ``window_s``."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    a @ b
    while time.time() < start_at:
        time.sleep(0.005)
    begin = time.perf_counter()
    calls = 0
    while time.perf_counter() - begin < window_s:
        for _ in range(8):
            a @ b
        calls += 8
    return 2 * 256**3 * calls / (time.perf_counter() - begin)


class RateProbe:
    """The compute rate the runs would get now: every rank's GEMM rate, measured at the same time.

    CPU: ``nproc`` worker processes (one thread each), started once and kept, so a probe costs about
    ``PROBE_WINDOW_S``; their FLOP/s add up. CUDA: a bf16 GEMM loop on the GPU.
    """

    def __init__(self, device: str, nproc: int) -> None:
        """Start the probe's workers (CPU) for ``nproc`` ranks.

        Raises:
            ConfigError: a device other than cpu or cuda, or fewer than one rank.
        """
        if device not in ("cpu", "cuda") or nproc < 1:
            raise ConfigError(
                f"the rate probe needs device cpu or cuda and nproc >= 1, got {device}, {nproc}"
            )
        self.device, self.nproc = device, nproc
        self._pool: ProcessPoolExecutor | None = None
        if device == "cpu":
            import multiprocessing

            self._pool = ProcessPoolExecutor(
                max_workers=nproc, mp_context=multiprocessing.get_context("spawn"), initializer=_probe_init
            )
            list(self._pool.map(_probe_rank, [0.0] * nproc, [0.05] * nproc))  # import torch in each

    def rate(self) -> float:
        """FLOP/s now (the sum over ranks on the CPU)."""
        if self._pool is not None:
            start = time.time() + 0.3  # every worker has its task by then
            rates = self._pool.map(_probe_rank, [start] * self.nproc, [PROBE_WINDOW_S] * self.nproc)
            return float(sum(rates))
        import torch

        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        a @ a
        torch.cuda.synchronize()
        begin, calls = time.perf_counter(), 0
        while time.perf_counter() - begin < PROBE_WINDOW_S:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
            calls += 10
        return 2 * 4096**3 * calls / (time.perf_counter() - begin)

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.shutdown()


def changed(reference: float, *rates: float) -> bool:
    """True when any of ``rates`` is off ``reference`` by more than RATE_TOLERANCE (relative)."""
    return any(abs(r / reference - 1) > RATE_TOLERANCE for r in rates)
