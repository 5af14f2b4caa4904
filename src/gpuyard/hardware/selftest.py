"""The GPU self-test of the node health check: a short GEMM checked against FP64, and a memory test.

:func:`selftest_gpu` runs it in a child process (``python -m gpuyard.hardware.selftest``) with
``CUDA_VISIBLE_DEVICES`` set to the one GPU, so the server never holds a CUDA context, and a GPU that
hangs costs a timeout, not the server. The child:

1. multiplies two random ``size x size`` FP32 matrices (TF32 off) twice; the two results must be
   bit-identical (same inputs, same kernel: a difference is silent data corruption), and 64 rows are
   compared with the same product in FP64 on the CPU (largest error relative to the largest value);
2. times ``iters`` more GEMMs (TFLOP/s, wall clock between two synchronisations);
3. fills ``memory_mb`` MiB with address-derived 32-bit words and their complement, and counts the
   words that read back wrong.

The last line of its output is one JSON object: the fields of
:class:`gpuyard.hardware.health.SelfTestResult`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from gpuyard import privileged
from gpuyard.hardware.health import SelfTestResult


def _run(size: int, memory_mb: int, iters: int, device: str = "cuda") -> dict[str, Any]:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return {"ok": None, "error": "CUDA is not available"}
    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda:0" if device == "cuda" else device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(1234)
    a = torch.randn(size, size, device=dev, generator=gen)
    b = torch.randn(size, size, device=dev, generator=gen)
    c1 = a @ b
    c2 = a @ b
    mismatches = int((c1 != c2).sum().item())
    rows = min(64, size)
    ref = a[:rows].double().cpu() @ b.double().cpu()
    rel_err = float((c1[:rows].double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b, out=c2)
    sync()
    tflops = 2 * size**3 * iters / max(time.perf_counter() - t0, 1e-9) / 1e12
    del a, b, c1, c2
    errors = 0
    words = memory_mb * 2**20 // 4
    if words:
        # Address-derived words (Knuth's multiplicative hash, wrapping in int32) and their complement.
        pattern = torch.arange(words, dtype=torch.int32, device=dev) * -1640531535
        buf = pattern.clone()
        errors += int((buf != pattern).sum().item())
        buf = ~pattern
        errors += int((buf != ~pattern).sum().item())
        del buf, pattern
    sync()
    ok = mismatches == 0 and errors == 0
    return {
        "ok": ok,
        "seconds": round(time.perf_counter() - start, 3),
        "gemm_tflops": round(tflops, 2),
        "gemm_rel_err": rel_err,
        "gemm_repeat_mismatches": mismatches,
        "memory_errors": errors,
        "error": "" if ok else "GEMM or memory results differ",
    }


def selftest_gpu(
    gpu: int,
    size: int = 4096,
    memory_mb: int = 512,
    timeout_s: float = 120.0,
    iters: int = 10,
    device: str = "cuda",
) -> SelfTestResult:
    """Self-test GPU ``gpu`` (an index as NVML and CUDA_VISIBLE_DEVICES count it) in a child process.

    Returns:
        The result; ``ok`` False when the child crashed or ran past ``timeout_s`` (a hung GPU), None
        when it could not test (no torch, no CUDA).
    """
    # The server (root) runs it: the privileged allow-list, not whatever its environment holds.
    env = privileged.environment({"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    argv = [sys.executable, "-m", "gpuyard.hardware.selftest", "--size", str(size)]
    argv += ["--memory-mb", str(memory_mb), "--iters", str(iters), "--device", device]
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return SelfTestResult(ok=False, seconds=timeout_s, error=f"no result within {timeout_s:g} s")
    took = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'torch'" in done.stderr:
            return SelfTestResult(ok=None, seconds=took, error="torch is not installed")
        return SelfTestResult(ok=False, seconds=took, error=f"exit {done.returncode}: {tail[:300]}")
    doc = json.loads(lines[-1])
    return SelfTestResult(**{**doc, "seconds": doc.get("seconds", took)})


def main(argv: list[str] | None = None) -> None:
    """Entry point of the child: run the test on cuda:0 and print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--memory-mb", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (the test), or cpu (to test the test)")
    args = parser.parse_args(argv)
    print(json.dumps(_run(args.size, args.memory_mb, args.iters, args.device)), flush=True)


if __name__ == "__main__":
    main()
