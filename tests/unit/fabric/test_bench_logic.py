"""Bench logic without processes: expected results per op, the fit, and config validation."""

from __future__ import annotations

import pytest
import torch

from gpuyard.errors import ConfigError
from gpuyard.fabric.bench import BenchConfig, BenchRow, _buffers, _elements, _steps, fit_link, validate_config
from gpuyard.fabric.collectives import OPS, bus_factor

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def _simulate(op: str, srcs: list[torch.Tensor], world: int, shift: int = 1) -> list[torch.Tensor]:
    """What each rank receives, by the collective's definition (shift != 1 is a wrong send/recv)."""
    chunks = [s.chunk(world) for s in srcs]
    if op == "all_reduce":
        return [sum(srcs)] * world  # type: ignore[list-item]
    if op == "all_gather":
        return [torch.cat(srcs)] * world
    if op == "reduce_scatter":
        return [sum(c[r] for c in chunks) for r in range(world)]  # type: ignore[misc]
    if op == "all_to_all":
        return [torch.cat([chunks[src][r] for src in range(world)]) for r in range(world)]
    if op == "broadcast":
        return [srcs[0]] * world
    return [srcs[(r - shift) % world] for r in range(world)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_expected_values_match_the_collective_definitions(op: str, world: int) -> None:
    count = _elements(op, 4096, world)
    bufs = [_buffers(op, count, r, world, CPU) for r in range(world)]
    received = _simulate(op, [b[0] for b in bufs], world)
    for r in range(world):
        assert torch.equal(received[r], bufs[r][2]), (op, world, r)


def test_a_wrong_result_is_caught() -> None:
    bufs = [_buffers("send_recv", 1024, r, 3, CPU) for r in range(3)]
    received = _simulate("send_recv", [b[0] for b in bufs], 3, shift=2)
    assert not any(torch.equal(received[r], bufs[r][2]) for r in range(3))


def test_fit_recovers_latency_and_bandwidth() -> None:
    hop, bw, world = 25e-6, 3e9, 4
    rows = []
    for op in ("all_reduce", "all_gather", "broadcast"):
        for size in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
            t = _steps(op, world) * hop + size * bus_factor(op, world) / bw
            rows.append(BenchRow(op, size, size // 4, t, 0.0, 0.0, True, 1))
    got_hop, got_bw = fit_link(rows, world)
    assert got_hop == pytest.approx(hop, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)
    with pytest.raises(ConfigError, match="two sizes"):
        fit_link(rows[:1], world)


def test_fit_falls_back_when_noise_hides_the_trend() -> None:
    # Big messages measured faster than small ones (a loaded machine): no negative bandwidth.
    rows = [
        BenchRow("all_reduce", 1 << 10, 256, 2e-3, 0, 0, True, 1),
        BenchRow("all_reduce", 1 << 20, 1 << 18, 1e-3, 0, 0, True, 1),
    ]
    hop, bw = fit_link(rows, 2)
    assert hop == pytest.approx(2e-3 / 2) and bw == pytest.approx((1 << 20) / 1e-3)


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (BenchConfig(nproc=1), "nproc"),
        (BenchConfig(ops=("all_sum",)), "unknown op"),
        (BenchConfig(iters=0), "iters"),
        (BenchConfig(backend="mpi"), "backend"),
        (BenchConfig(sizes=()), "sizes"),
    ],
)
def test_bad_bench_config(cfg: BenchConfig, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        validate_config(cfg)
