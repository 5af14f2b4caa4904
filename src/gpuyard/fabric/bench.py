"""Measured collectives: nccl-tests-style runs over torch.distributed (NCCL on GPUs, gloo on CPU).

Each (op, size) is warmed up, then timed over several iterations; the time reported is the slowest
rank's average, as in nccl-tests. Every result is checked once against a closed-form expectation
(inputs are small integers, exact in fp32). ``fit_link`` turns the measurements into a latency and a
bandwidth, and ``calibrated_cluster`` writes them into a cluster that the cost model and planner use.

One host: ``run_bench`` spawns the ranks itself. Several hosts: start the same command under
torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR); ``run_bench`` then joins that rendezvous.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster, IntraNode, Nic
from gpuyard.fabric.collectives import OPS, bus_factor

DTYPE_BYTES = 4  # float32: gloo reduces it everywhere and small integers stay exact
# Per (op, size): stop adding timed iterations after about this many seconds (slow CPU links).
TIME_BUDGET_S = 0.5


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    nproc: int = 2
    ops: tuple[str, ...] = (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "send_recv",
    )
    sizes: tuple[int, ...] = (1024, 1 << 20)
    warmup: int = 2
    iters: int = 10
    backend: str = "auto"


@dataclass(frozen=True)
class BenchRow:
    """One measured (op, size): nccl-tests' columns plus the correctness verdict."""

    op: str
    size_bytes: int
    count: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    correct: bool
    iters: int

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form."""
        return asdict(self)


def validate_config(cfg: BenchConfig) -> None:
    """Reject unknown ops, sizes that do not split across ranks and bad counts (before any process starts).

    Raises:
        ConfigError: the message names the offending value.
    """
    if cfg.nproc < 2:
        raise ConfigError(f"--nproc must be at least 2 to measure a collective, got {cfg.nproc}")
    if cfg.iters < 1 or cfg.warmup < 0:
        raise ConfigError(f"iters must be >= 1 and warmup >= 0, got {cfg.iters} and {cfg.warmup}")
    for op in cfg.ops:
        if op not in OPS:
            raise ConfigError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend must be auto, gloo or nccl, got {cfg.backend!r}")
    if not cfg.sizes:
        raise ConfigError("no sizes to measure")


def _elements(op: str, size: int, world: int) -> int:
    """Element count of the nccl-tests buffer, rounded down to a multiple of the world size."""
    count = max(world, size // DTYPE_BYTES)
    return count - count % world if op in ("all_gather", "reduce_scatter", "all_to_all") else count


def _buffers(op: str, count: int, rank: int, world: int, device: Any) -> tuple[Any, Any, Any]:
    """(input, output, expected output) for one op; patterns are small integers so fp32 sums are exact."""
    import torch

    def pattern(n: int, offset: int = 0) -> Any:
        return (torch.arange(offset, offset + n, device=device) % 13).float()

    chunk = count // world
    if op == "all_reduce":
        src = pattern(count) + rank
        return src, src, world * pattern(count) + world * (world - 1) / 2
    if op == "all_gather":
        src = pattern(chunk, rank * chunk) + rank
        expected = torch.cat([pattern(chunk, r * chunk) + r for r in range(world)])
        return src, torch.empty(count, device=device), expected
    if op == "reduce_scatter":
        src = pattern(count) + rank
        expected = world * pattern(chunk, rank * chunk) + world * (world - 1) / 2
        return src, torch.empty(chunk, device=device), expected
    if op == "all_to_all":  # rank r's j-th chunk goes to rank j: value 100*r + j
        src = torch.cat([torch.full((chunk,), 100.0 * rank + j, device=device) for j in range(world)])
        expected = torch.cat([torch.full((chunk,), 100.0 * r + rank, device=device) for r in range(world)])
        return src, torch.empty(count, device=device), expected
    if op == "broadcast":
        src = pattern(count) if rank == 0 else torch.zeros(count, device=device)
        return src, src, pattern(count)
    # send_recv: a ring shift, every rank sends to the next and receives from the previous
    src = pattern(count) + rank
    return src, torch.empty(count, device=device), pattern(count) + (rank - 1) % world


def _run_op(op: str, src: Any, out: Any, rank: int, world: int) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(src)
    elif op == "all_gather":  # *_single are the current names; *_tensor the older ones
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, src)
    elif op == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, src)
    elif op == "all_to_all":
        dist.all_to_all_single(out, src)
    elif op == "broadcast":
        dist.broadcast(src, 0)
    else:
        ops = [
            dist.P2POp(dist.isend, src, (rank + 1) % world),
            dist.P2POp(dist.irecv, out, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(op: str, size: int, cfg: BenchConfig, rank: int, world: int, device: Any) -> BenchRow:
    import torch
    import torch.distributed as dist

    count = _elements(op, size, world)
    src, out, expected = _buffers(op, count, rank, world, device)
    _run_op(op, src, out, rank, world)  # the checked run, on fresh patterned data
    result = src if op in ("all_reduce", "broadcast") else out
    ok = torch.tensor([1.0 if torch.equal(result, expected) else 0.0], device=device)
    scratch_src, scratch_out, _ = _buffers(op, count, rank, world, device)
    scratch_src.zero_()  # timed runs reduce zeros: values never grow, timing does not depend on them
    for _ in range(cfg.warmup):
        _run_op(op, scratch_src, scratch_out, rank, world)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    _run_op(op, scratch_src, scratch_out, rank, world)
    _sync(device)
    first = time.perf_counter() - start
    # Slow links (gloo on CPU): fewer iterations for big messages, agreed by all ranks (the fewest wins).
    wanted = float(min(cfg.iters, max(1, math.ceil(TIME_BUDGET_S / max(first, 1e-9)))))
    planned = torch.tensor([wanted], device=device)
    dist.all_reduce(planned, op=dist.ReduceOp.MIN)
    iters = int(planned.item())
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        _run_op(op, scratch_src, scratch_out, rank, world)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    t = float(elapsed.item())
    nbytes = count * DTYPE_BYTES
    algbw = nbytes / t / 1e9
    return BenchRow(op, nbytes, count, t, algbw, algbw * bus_factor(op, world), bool(ok.item() == 1.0), iters)


def _device(backend: str, local_rank: int) -> tuple[str, Any]:
    import torch

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def _measure_all(cfg: BenchConfig, rank: int, world: int, local_rank: int) -> tuple[str, list[BenchRow]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the host's cores; more threads only contend
    backend, device = _device(cfg.backend, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        rows = [_measure(op, size, cfg, rank, world, device) for op in cfg.ops for size in cfg.sizes]
    finally:
        dist.destroy_process_group()
    return backend, rows


def _spawned(rank: int, world: int, cfg: BenchConfig, port: int, out: str) -> None:
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend, rows = _measure_all(cfg, rank, world, rank)
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "rows": [r.to_dict() for r in rows]}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class BenchResult:
    """All rows of one run and where it ran."""

    backend: str
    world_size: int
    local_world_size: int
    rank: int
    rows: list[BenchRow]

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form."""
        return {
            "backend": self.backend,
            "nproc": self.world_size,
            "local_nproc": self.local_world_size,
            "results": [r.to_dict() for r in self.rows],
        }


def under_torchrun() -> bool:
    """True when started by torchrun (or any launcher that sets the env:// rendezvous variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Measure the collectives: spawn ``cfg.nproc`` local ranks, or join torchrun's rendezvous.

    Raises:
        ConfigError: invalid configuration.
        GpuyardError subclasses are not raised by workers; a worker crash surfaces as ConfigError.
    """
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        validate_config(replace(cfg, nproc=world))
        backend, rows = _measure_all(cfg, rank, world, int(os.environ.get("LOCAL_RANK", 0)))
        return BenchResult(backend, world, local_world, rank, rows)
    validate_config(cfg)
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gpuyard-bench-") as tmp:
        out = str(Path(tmp) / "rows.json")
        try:
            # torch.multiprocessing.spawn has no annotations
            mp.spawn(_spawned, args=(cfg.nproc, cfg, _free_port(), out), nprocs=cfg.nproc, join=True)  # type: ignore[no-untyped-call]
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise ConfigError(f"a benchmark rank failed: {last}") from None
        data = json.loads(Path(out).read_text())
    rows = [BenchRow(**r) for r in data["rows"]]
    return BenchResult(data["backend"], cfg.nproc, cfg.nproc, 0, rows)


def _steps(op: str, n: int) -> int:
    """Latency steps of the ring (or direct) algorithm the measured libraries use for ``op``."""
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "broadcast": n - 1}.get(
        op, 1
    )


def fit_link(rows: list[BenchRow], world: int) -> tuple[float, float]:
    """Fit ``time = steps x hop latency + bytes on the wire / bandwidth`` to the measurements.

    Returns:
        (hop latency in seconds, bandwidth in bytes/s), by least squares on relative error so that
        small messages (latency) and large ones (bandwidth) both count.

        When noise hides the trend (a non-positive slope or latency), the bandwidth of the largest
        messages and the latency of the smallest are used instead.

    Raises:
        ConfigError: fewer than two distinct sizes were measured correctly.
    """
    import numpy as np

    points = [(r, _steps(r.op, world), r.size_bytes * bus_factor(r.op, world)) for r in rows if r.correct]
    if len({r.size_bytes for r, _, _ in points}) < 2:
        raise ConfigError("calibration needs correct results at two sizes or more (e.g. --sizes 1KiB:64MiB)")
    design = np.array([[steps, wire] for _, steps, wire in points], dtype=float)
    times = np.array([r.time_s for r, _, _ in points], dtype=float)
    weights = 1.0 / times
    coef, *_ = np.linalg.lstsq(design * weights[:, None], times * weights, rcond=None)
    hop, inv_bw = float(coef[0]), float(coef[1])
    if inv_bw > 0 and hop > 0:
        return hop, 1.0 / inv_bw
    largest = max(r.size_bytes for r, _, _ in points)
    smallest = min(r.size_bytes for r, _, _ in points)
    bw = max(wire / r.time_s for r, _, wire in points if r.size_bytes == largest)
    hop = min(r.time_s / steps for r, steps, _ in points if r.size_bytes == smallest)
    return max(hop, 1e-7), bw


def calibrated_cluster(base: Cluster, result: BenchResult) -> Cluster:
    """``base`` with its links replaced by the fitted latency and bandwidth (alpha-beta collectives).

    One host: the ranks become the node's devices and the fit sets the intra-node link. Several
    hosts: the fit sets the network link (the slowest hop of a ring that crosses nodes).
    """
    hop, bw = fit_link(result.rows, result.world_size)
    note = (
        f"calibrated by `gpuyard fabric bench` ({result.backend}, {result.world_size} ranks): "
        f"hop {hop * 1e6:.2f} us, {bw / 1e9:.3f} GB/s"
    )
    update: dict[str, object] = {
        "name": f"{base.name}-calibrated",
        "collective_model": "alpha-beta",
        "sources": (*base.sources, note),
    }
    if result.local_world_size >= result.world_size:
        update["gpus_per_node"] = result.world_size
        update["nodes"] = 1
        update["intra"] = IntraNode(
            kind=base.intra.kind,
            nvlink_generation=base.intra.nvlink_generation,
            bw_GBps=bw / 1e9,
            latency_us=hop * 1e6,
            bw_efficiency=1.0,
        )
    else:
        update["gpus_per_node"] = result.local_world_size
        update["nic"] = Nic(
            count=1,
            gbps=bw * 8 / 1e9,
            kind=base.nic.kind,
            gpudirect_rdma=base.nic.gpudirect_rdma,
            latency_us=hop * 1e6,
            bw_efficiency=1.0,
        )
    data = base.model_dump()
    data.update({k: v.model_dump() if isinstance(v, (IntraNode, Nic)) else v for k, v in update.items()})
    return Cluster.model_validate(data)
