"""The GPU self-test on a real GPU: it passes, within its timeout, at a plausible speed."""

from __future__ import annotations

import pytest
import torch

from gpuyard.hardware.selftest import selftest_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_selftest_passes_on_a_healthy_gpu() -> None:
    result = selftest_gpu(0, size=4096, memory_mb=512, timeout_s=120)
    assert result.ok is True, result.error
    assert result.gemm_rel_err is not None and result.gemm_rel_err < 1e-4
    assert result.gemm_tflops is not None and result.gemm_tflops > 1.0
    took, speed, err = result.seconds, result.gemm_tflops, result.gemm_rel_err
    print(f"selftest: {took:.2f} s, {speed:.1f} TFLOP/s FP32, err {err:.2g}")
