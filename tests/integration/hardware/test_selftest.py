"""The GPU self-test's child process: its checks run (on the CPU here), and a missing GPU or a hang is
reported as such."""

from __future__ import annotations

import pytest

from gpuyard.hardware.fake import FakeNvml
from gpuyard.hardware.health import NodeCheckConfig, check_node
from gpuyard.hardware.selftest import selftest_gpu

pytestmark = pytest.mark.integration


def test_the_checks_run_and_pass_on_a_sound_device() -> None:
    result = selftest_gpu(0, size=256, memory_mb=4, device="cpu")
    assert result.ok is True, result.error
    assert result.gemm_repeat_mismatches == 0 and result.memory_errors == 0
    assert result.gemm_rel_err is not None and 0 < result.gemm_rel_err < 1e-5


def test_no_cuda_is_not_held_against_the_gpu_and_a_hang_is() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    missing = selftest_gpu(0, size=64, memory_mb=1)
    assert missing.ok is None and "CUDA" in missing.error
    hung = selftest_gpu(0, size=64, memory_mb=1, timeout_s=0.01)
    assert hung.ok is False and "no result within" in hung.error
    nv = FakeNvml({"nvml": {"gpus": [{"name": "H100"}]}})
    config = NodeCheckConfig(checks=("selftest",))
    assert check_node(nv, config, idle={0}, selftest=lambda i: missing).verdict == "pass"
    failed = check_node(nv, config, idle={0}, selftest=lambda i: hung)
    assert failed.verdict == "fail" and "no result within" in failed.reasons[0]
