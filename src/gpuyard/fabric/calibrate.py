"""Calibration by measurement: GEMMs, attention, memory, copies, dispatch, overlap and collectives here.

``gpuyard fabric calibrate`` runs one process per rank on this host (one per GPU, or ``--nproc`` CPU
ranks), all measuring at once, so each rank sees the share of the machine a training run of that many
ranks gets (on a CPU host torchrun gives every rank one thread). It writes a calibration file; the step
model, the planner, fabric-aware placement and the simulator apply it to a cluster with
:func:`apply_calibration`, which refuses a file measured on another device. The file's schema, reading,
writing and application live in :mod:`gpuyard.fabric.calibration` (importable from here too).

What is measured and what it sets in the cluster:

* GEMMs over shapes (M, N, K) and dtypes -> the large-GEMM efficiency per dtype and the dimensions at
  which a GEMM reaches half of it (``Compute.dtype_efficiency``, ``Compute.gemm_half``), fitted to
  ``tflops = peak x sat_M(M) sat_N(N) sat_K(K)`` with ``sat(x) = x / (x + half)``: the shape law the
  step model applies to every GEMM of a layer, forward and backward.
* Causal scaled-dot-product attention, forward and backward -> ``Compute.attention_efficiency``.
* A streaming add -> memory bandwidth per rank; tiny ops -> dispatch cost per kernel.
* Host-to-device and device-to-host copies (CUDA only), recorded.
* A GEMM loop with and without a concurrent all_reduce -> how much of hidden communication still
  costs compute time (``Compute.overlap_slowdown``; NCCL kernels hold SMs, gloo holds CPU cores).
* Collectives nccl-tests style (:mod:`gpuyard.fabric.bench`) -> per-op latency and bandwidth.
* Device memory (CUDA only), after everything above has run: what the process holds outside PyTorch's
  caching allocator (``torch.cuda.mem_get_info`` used bytes minus ``torch.cuda.memory_reserved``: the
  CUDA context, cuBLAS/cuDNN handles, NCCL communicators and buffers) -> ``Compute.memory_reserved_bytes``;
  and the allocator's overhead, peak reserved over peak allocated over a few training steps of a small
  transformer whose batch shape changes every step -> ``Compute.memory_fragmentation``. Measure on an
  otherwise idle GPU: memory other processes hold on it would count as this process's reserve.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.fabric.calibration import (
    FORMAT,
    Calibration,
    GemmFit,
    GemmPoint,
    add_storage,
    apply_calibration,
    check_writable,
    load_calibrated,
    load_calibration,
    save_calibration,
)
from gpuyard.fabric.cluster import MeasuredLink

__all__ = [
    "FORMAT",
    "CalibrateConfig",
    "Calibration",
    "GemmFit",
    "GemmPoint",
    "add_storage",
    "apply_calibration",
    "check_writable",
    "fit_gemms",
    "gemm_shapes",
    "load_calibrated",
    "load_calibration",
    "measure_attention",
    "measure_copies",
    "measure_elementwise",
    "measure_fragmentation",
    "measure_gemms",
    "measure_memory_bw",
    "measure_memory_reserve",
    "measure_op_overhead",
    "measure_overlap",
    "run_calibration",
    "save_calibration",
]

# Each timed measurement stops adding iterations after about this long: enough for a stable median on a
# loaded 2-core machine, short enough that a whole CPU calibration takes about a minute.
TIME_BUDGET_S = 0.25
# Collective sizes: 4 KiB to 64 MiB by 4x covers latency- and bandwidth-bound ends for the fit.
# One timed sample lasts at least this long, so that launch and synchronisation are amortised.
SAMPLE_S = 2e-3
COLLECTIVE_SIZES = tuple(4096 * 4**i for i in range(9))
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class CalibrateConfig:
    """What to measure: ranks on this host, backend, and a quick mode for tests."""

    nproc: int = 1
    backend: str = "auto"
    quick: bool = False


# ----- measurements (run inside each rank) -------------------------------------------------------


def _timed(fn: Any, sync: Any, budget: float = TIME_BUDGET_S, calls: int | None = None) -> float:
    """Median seconds per call of ``fn`` after one warm-up, adding samples until ``budget`` is spent.

    A sample runs ``fn`` back to back until it lasts about SAMPLE_S before one synchronisation, so a
    GPU kernel's time is not the launch-and-sync round trip. ``calls`` fixes the count of single-call
    samples instead: a function that runs a collective must be called equally often on every rank.
    """
    fn()
    sync()
    reps = 1
    if not calls:
        start = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - start
        reps = max(1, min(1000, math.ceil(SAMPLE_S / max(once, 1e-7))))
    times: list[float] = []
    spent = 0.0
    while (len(times) < calls) if calls else (spent < budget or len(times) < 3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        times.append(elapsed / reps)
        spent += elapsed
        if len(times) >= 50:
            break
    times.sort()
    return times[len(times) // 2]


def gemm_shapes(device_kind: str, quick: bool) -> list[tuple[int, int, int]]:
    """Square and skinny shapes, small to large, as transformer layers produce them."""
    if device_kind == "cpu":
        dims, squares = [64, 128, 256, 512, 1024], [64, 128, 256, 512, 1024]
    else:  # squares below 2048 are bound by launch and dispatch, which calibration measures apart
        dims, squares = [256, 512, 1024, 2048, 4096, 8192], [2048, 4096, 8192]
    if quick:
        dims, squares = dims[:3], squares[:2]
    shapes = [(d, d, d) for d in squares]
    big = dims[-1]
    for d in dims[:-1]:  # one small dimension at a time: rows (tokens), then width
        shapes += [(d, big, big), (big, d, big), (big, big, d)]
    return shapes


def _dtypes(device_kind: str) -> list[str]:
    # CPU runs train in fp32 (precision auto); GPUs in bf16, with fp32 measured for fp32 runs.
    return ["float32"] if device_kind == "cpu" else ["bfloat16", "float32"]


def measure_gemms(device: Any, quick: bool, sync: Any) -> list[GemmPoint]:
    """TFLOP/s of ``torch.matmul`` over :func:`gemm_shapes` in each training dtype."""
    import torch

    points = []
    for dtype_name in _dtypes(device.type):
        dtype = getattr(torch, dtype_name)
        for m, n, k in gemm_shapes(device.type, quick):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            t = _timed(lambda a=a, b=b: torch.matmul(a, b), sync)
            points.append(GemmPoint(dtype=dtype_name, m=m, n=n, k=k, tflops=2 * m * n * k / t / 1e12))
    return points


def _sat(x: float, half: float) -> float:
    return x / (x + half)


HALF_GRID = (0.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0)


def fit_gemms(points: list[GemmPoint], ceilings: dict[str, float] | None = None) -> dict[str, GemmFit]:
    """Per dtype, the peak and (M, N, K) half-dimensions minimising the relative error of the shape law.

    ``ceilings`` caps the fitted peak per dtype (the datasheet's): a law that needs more than the
    hardware can do to fit the points is the wrong law, and the cap keeps large shapes honest.

    Raises:
        ConfigError: no points for a dtype.
    """
    import itertools

    fits = {}
    for dtype in sorted({p.dtype for p in points}):
        pts = [p for p in points if p.dtype == dtype]
        if not pts:
            raise ConfigError(f"no GEMM measured in {dtype}")
        best: tuple[float, GemmFit] | None = None
        for hm, hn, hk in itertools.product(HALF_GRID, repeat=3):
            shape = [_sat(p.m, hm) * _sat(p.n, hn) * _sat(p.k, hk) for p in pts]
            # For fixed halves the best peak in log space is the geometric mean of the ratios.
            logs = [math.log(p.tflops / s) for p, s in zip(pts, shape, strict=True)]
            peak = math.exp(sum(logs) / len(logs))
            if ceilings and dtype in ceilings:
                peak = min(peak, ceilings[dtype])
            errs = sorted(abs(peak * s / p.tflops - 1) for p, s in zip(pts, shape, strict=True))
            score = sum(e * e for e in errs)
            if best is None or score < best[0]:
                fit = GemmFit(
                    peak_tflops=peak,
                    half_m=hm,
                    half_n=hn,
                    half_k=hk,
                    median_error=errs[len(errs) // 2],
                    max_error=errs[-1],
                )
                best = (score, fit)
        assert best is not None  # the grid is never empty
        fits[dtype] = best[1]
    return fits


def measure_attention(device: Any, dtype_name: str, quick: bool, sync: Any) -> float:
    """TFLOP/s of causal scaled-dot-product attention, forward and backward (causal FLOPs counted)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    b, heads, head_dim = (2, 4, 64) if device.type == "cpu" else (4, 16, 128)
    seq = 256 if device.type == "cpu" or quick else 4096
    q, k, v = (
        torch.randn(b, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(out.sum())  # Tensor.backward has no annotations

    t = _timed(step, sync)
    # Causal: half of QK^T and PV (2 x 2 b h s^2 d) forward; backward about 2.5x the forward.
    flops = 3.5 * 2 * b * heads * seq * seq * head_dim
    return flops / t / 1e12


def measure_memory_bw(device: Any, sync: Any) -> float:
    """GB/s of ``a + b -> c`` on buffers larger than any cache (reads two, writes one)."""
    import torch

    n = (64 << 20) // 4 if device.type == "cpu" else (1 << 30) // 4
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    c = torch.empty_like(a)
    t = _timed(lambda: torch.add(a, b, out=c), sync)
    return 3 * n * 4 / t / 1e9


def measure_elementwise(device: Any, dtype_name: str, sync: Any) -> float:
    """Effective GB/s of a transformer's memory-bound operators (layer norm, GELU, residual add, dropout).

    Forward and backward on an activation the size a layer produces; bytes counted as the step model
    counts them (each operator reads its inputs and writes its output once). On a GPU this comes out
    near the memory bandwidth; on a CPU thread these operators are bound by arithmetic (erf, reductions)
    well below it, which a streaming copy would not show.
    """
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    rows, width = (2048, 256) if device.type == "cpu" else (16384, 4096)
    x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(width, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(width, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        y = F.layer_norm(x, (width,), w, b)
        z = F.dropout(F.gelu(y), 0.1, training=True) + x
        torch.autograd.backward(z.sum())  # Tensor.backward has no annotations

    t = _timed(step, sync)
    # Elements moved: norm 2 fwd + 3 bwd, GELU 2 + 3, dropout 3 (mask) + 2, add 3 + 2, sum 1 + 1.
    moved = 22 * rows * width * x.element_size()
    return moved / t / 1e9


def measure_op_overhead(device: Any, sync: Any) -> float:
    """Microseconds per tiny kernel: framework dispatch (CPU) or launch and issue (CUDA)."""
    import torch

    x = torch.ones(8, device=device)
    ops = 200

    def loop() -> None:
        for _ in range(ops):
            x.add_(0.0)

    return _timed(loop, sync) / ops * 1e6


def measure_copies(device: Any, sync: Any) -> tuple[float | None, float | None]:
    """(host-to-device, device-to-host) GB/s from pinned memory; (None, None) on a CPU."""
    import torch

    if device.type != "cuda":
        return None, None
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), sync)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), sync)
    return n / h2d / 1e9, n / d2h / 1e9


def measure_overlap(device: Any, world: int, sync: Any) -> float | None:
    """Share of a hidden all_reduce's time that still slows a concurrent GEMM loop (0 = free, 1 = serial)."""
    import torch
    import torch.distributed as dist

    if world < 2 or not dist.is_initialized():
        return None
    d = 256 if device.type == "cpu" else 4096
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(d, d, device=device, dtype=dtype)
    buf = torch.zeros((16 << 20) // 4, device=device)

    def gemms(reps: int) -> None:
        for _ in range(reps):
            torch.matmul(a, a)

    def comm() -> None:
        dist.all_reduce(buf)

    dist.barrier()
    t_comm = _timed(comm, sync, calls=7)
    t_one = _timed(lambda: gemms(1), sync)
    reps = max(1, math.ceil(2 * t_comm / t_one))  # compute long enough to hide the collective
    dist.barrier()
    t_compute = _timed(lambda: gemms(reps), sync)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        gemms(reps)
        assert work is not None  # async_op=True always returns a handle
        work.wait()

    dist.barrier()
    t_both = _timed(both, sync, calls=7)
    slow = torch.tensor([(t_both - t_compute) / t_comm], dtype=torch.float64)
    dist.all_reduce(slow)  # every rank's view, averaged: the ranks contend for the same resources
    return float(min(1.0, max(0.0, slow.item() / world)))


# Training-like loop for the allocator's overhead: (batch, sequence) per step, changing every step as a
# data loader with variable-length batches makes it; the model is a pre-norm transformer of this width.
FRAGMENTATION_STEPS = ((4, 2048), (2, 4096), (8, 1024), (3, 3072), (6, 1536), (1, 8192), (5, 2560), (4, 2048))
FRAGMENTATION_WIDTH, FRAGMENTATION_LAYERS = 2048, 6


def measure_fragmentation(device: Any, quick: bool) -> float | None:
    """Peak reserved / peak allocated by PyTorch's caching allocator over a short training loop (CUDA).

    A small pre-norm transformer (bf16 autocast, causal SDPA, fused AdamW) trains for a few steps whose
    batch shape changes every step, so freed blocks are reused by tensors of other sizes, as in a run
    with variable-length batches; everything cached before it is released first. None on a CPU.
    """
    import torch
    import torch.nn.functional as F

    if device.type != "cuda":
        return None
    width, layers = (512, 2) if quick else (FRAGMENTATION_WIDTH, FRAGMENTATION_LAYERS)
    heads = width // 128
    steps = [(b, s // 4) for b, s in FRAGMENTATION_STEPS] if quick else list(FRAGMENTATION_STEPS)

    def linear(i: int, o: int) -> torch.nn.Linear:
        return torch.nn.Linear(i, o, bias=False, device=device)

    def norm() -> torch.nn.LayerNorm:
        return torch.nn.LayerNorm(width, device=device)

    # (norm, qkv, out, norm, up, down) per block
    blocks = [
        (
            norm(),
            linear(width, 3 * width),
            linear(width, width),
            norm(),
            linear(width, 4 * width),
            linear(4 * width, width),
        )
        for _ in range(layers)
    ]
    params = [p for block in blocks for module in block for p in module.parameters()]
    optim = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        for norm1, qkv, out, norm2, up, down in blocks:
            q, k, v = qkv(norm1(x)).view(b, s, 3, heads, width // heads).unbind(2)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + out(a.transpose(1, 2).reshape(b, s, width))
            x = x + down(F.gelu(up(norm2(x))))
        return x

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    for batch, seq in steps:
        x = torch.randn(batch, seq, width, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x).float().pow(2).mean()
        torch.autograd.backward(loss)  # Tensor.backward has no annotations
        optim.step()
        optim.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    blocks.clear()
    params.clear()
    optim.state.clear()
    torch.cuda.empty_cache()
    return max(1.0, reserved / allocated) if allocated else None


def measure_memory_reserve(device: Any) -> int | None:
    """Bytes this process holds on its GPU outside PyTorch's caching allocator (None on a CPU).

    ``torch.cuda.mem_get_info`` gives the device's used bytes (all of it, whoever holds it) and
    ``torch.cuda.memory_reserved`` what the caching allocator holds; the rest is the CUDA context, the
    cuBLAS and cuDNN handles and workspaces outside the allocator and NCCL's communicators and buffers.
    Called after the GEMMs, attention and collectives have run, so each of them has started.
    """
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free) - int(torch.cuda.memory_reserved(device)))


def _rank_measure(cfg: CalibrateConfig, rank: int, world: int, device: Any) -> dict[str, Any]:
    """Everything one rank measures; all ranks run it at once."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    barrier()
    gemm = measure_gemms(device, cfg.quick, sync)
    barrier()
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    attention = measure_attention(device, dtype, cfg.quick, sync)
    barrier()
    memory = measure_memory_bw(device, sync)
    barrier()
    elementwise = measure_elementwise(device, dtype, sync)
    barrier()
    overhead = measure_op_overhead(device, sync)
    h2d, d2h = measure_copies(device, sync)
    overlap = measure_overlap(device, world, sync)
    return {
        "gemm": [p.model_dump() for p in gemm],
        "attention_tflops": attention,
        "memory_bw_GBps": memory,
        "elementwise_GBps": elementwise,
        "op_overhead_us": overhead,
        "h2d_GBps": h2d,
        "d2h_GBps": d2h,
        "overlap_slowdown": overlap,
    }


def _collectives(cfg: CalibrateConfig, rank: int, world: int, device: Any) -> list[dict[str, Any]]:
    from gpuyard.fabric.bench import BenchConfig, _measure

    if world < 2:
        return []
    sizes = COLLECTIVE_SIZES[:5] if cfg.quick else COLLECTIVE_SIZES
    bench = BenchConfig(nproc=world, ops=COLLECTIVE_OPS, sizes=sizes, warmup=1, iters=5 if cfg.quick else 10)
    return [_measure(op, s, bench, rank, world, device).to_dict() for op in COLLECTIVE_OPS for s in sizes]


def _threads(world: int) -> int:
    # torchrun's rule, which `gpuyard train --nproc N` inherits: one OpenMP thread per rank when N > 1.
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return 1 if world > 1 else max(1, os.cpu_count() or 1)


def _worker(rank: int, world: int, cfg: CalibrateConfig, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from gpuyard.fabric.bench import _device

    torch.manual_seed(rank)
    backend, device = _device(cfg.backend, rank)
    if device.type == "cpu":
        torch.set_num_threads(_threads(world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        doc = _rank_measure(cfg, rank, world, device)
        doc["collectives"] = _collectives(cfg, rank, world, device)
        # Last, so that CUDA, cuBLAS, attention kernels and NCCL (its communicators) have all started.
        doc["memory_fragmentation"] = measure_fragmentation(device, cfg.quick)
        doc["memory_reserved_bytes"] = measure_memory_reserve(device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    doc["backend"] = backend if world > 1 else None
    doc["device_kind"] = device.type
    doc["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    doc["threads_per_rank"] = torch.get_num_threads() if device.type == "cpu" else 1
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


def _cpu_name() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _combine(docs: list[dict[str, Any]], world: int) -> Calibration:
    """One calibration from every rank's measurements: per point the median over ranks."""
    from gpuyard.fabric.bench import BenchRow, fit_link
    from gpuyard.hardware.catalog import match_spec

    first = docs[0]
    spec = match_spec(first["device_name"]) if first["device_kind"] == "cuda" else None
    gemm = []
    for i, p in enumerate(first["gemm"]):
        gemm.append(GemmPoint(**{**p, "tflops": _median([d["gemm"][i]["tflops"] for d in docs])}))
    ceilings = {}
    if spec is not None:
        for name, short in (("bfloat16", "bf16"), ("float32", "fp32")):
            value = getattr(spec, f"{short}_tflops", None)
            if value:
                ceilings[name] = float(value)
    fits = fit_gemms(gemm, ceilings)
    attention = _median([d["attention_tflops"] for d in docs])
    dtype = "float32" if first["device_kind"] == "cpu" else "bfloat16"
    links = {}
    rows = [BenchRow(**r) for r in first["collectives"]]
    for op in COLLECTIVE_OPS:
        mine = [r for r in rows if r.op == op]
        if len({r.size_bytes for r in mine if r.correct}) >= 2:
            hop, bw = fit_link(mine, world)
            links[op] = MeasuredLink(hop_us=hop * 1e6, bw_GBps=bw / 1e9)
    return Calibration(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        device_kind=first["device_kind"],
        device_name=first["device_name"],
        accelerator=spec.name
        if spec
        else ("custom" if first["device_kind"] == "cpu" else first["device_name"]),
        ranks=world,
        threads_per_rank=first["threads_per_rank"],
        backend=first["backend"],
        gemm=gemm,
        gemm_fit=fits,
        attention_tflops=attention,
        # Attention against the GEMM law at the attention's own sizes (seq x head_dim tiles).
        attention_efficiency=min(1.0, attention / fits[dtype].peak_tflops),
        memory_bw_GBps=_median([d["memory_bw_GBps"] for d in docs]),
        elementwise_GBps=_median([d["elementwise_GBps"] for d in docs]),
        op_overhead_us=_median([d["op_overhead_us"] for d in docs]),
        h2d_GBps=first["h2d_GBps"],
        d2h_GBps=first["d2h_GBps"],
        overlap_slowdown=first["overlap_slowdown"],
        collectives=first["collectives"],
        links=links,
        memory_reserved_bytes=_median_or_none([d.get("memory_reserved_bytes") for d in docs]),
        memory_fragmentation=_median_or_none([d.get("memory_fragmentation") for d in docs]),
    )


def _median_or_none(values: list[Any]) -> Any:
    """Median over the ranks that measured (CUDA ranks), None where none did."""
    measured = [v for v in values if v is not None]
    return _median(measured) if measured else None


def run_calibration(cfg: CalibrateConfig) -> Calibration:
    """Measure this host with ``cfg.nproc`` ranks at once and return the calibration.

    Raises:
        ConfigError: a bad rank count or backend, or a rank failed (the message has its last line).
    """
    import torch

    if cfg.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend must be auto, gloo or nccl, got {cfg.backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.backend == "nccl" and not gpus:
        raise ConfigError("--backend nccl needs CUDA GPUs and this machine has none: use gloo (or auto)")
    if cfg.backend != "gloo" and gpus and cfg.nproc > gpus:
        raise ConfigError(f"--nproc {cfg.nproc} exceeds the {gpus} GPUs of this host")
    with tempfile.TemporaryDirectory(prefix="gpuyard-calibrate-") as tmp:
        if cfg.nproc == 1:
            _worker(0, 1, cfg, 0, tmp)
        else:
            import torch.multiprocessing as mp

            try:
                # torch.multiprocessing.spawn has no annotations
                mp.spawn(_worker, args=(cfg.nproc, cfg, _free_port(), tmp), nprocs=cfg.nproc, join=True)  # type: ignore[no-untyped-call]
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                raise ConfigError(f"a calibration rank failed: {str(exc).strip().splitlines()[-1]}") from None
        docs = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(cfg.nproc)]
    return _combine(docs, cfg.nproc)
