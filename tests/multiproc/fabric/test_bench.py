"""Measured collectives on 2 gloo ranks: every op correct, nccl-tests columns, calibration round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.fabric.bench import BenchConfig, calibrated_cluster, run_bench
from gpuyard.fabric.cluster import load_cluster, save_cluster
from gpuyard.fabric.collectives import OPS, bus_factor, estimate

pytestmark = pytest.mark.multiproc


def test_two_ranks_measure_every_op_correctly_and_calibrate(tmp_path: Path) -> None:
    result = run_bench(BenchConfig(nproc=2, sizes=(4096, 1 << 18), warmup=1, iters=3, backend="gloo"))
    assert result.backend == "gloo" and result.world_size == 2
    assert [(r.op, r.size_bytes) for r in result.rows] == [(op, s) for op in OPS for s in (4096, 1 << 18)]
    for row in result.rows:
        assert row.correct, row
        assert row.time_s > 0 and 1 <= row.iters <= 3
        assert row.algbw_GBps == pytest.approx(row.size_bytes / row.time_s / 1e9)
        assert row.busbw_GBps == pytest.approx(row.algbw_GBps * bus_factor(row.op, 2))
    fitted = calibrated_cluster(load_cluster("local"), result)
    assert fitted.gpus_per_node == 2 and fitted.collective_model == "alpha-beta"
    assert fitted.intra.bw_GBps > 0 and fitted.intra.latency_us > 0
    path = tmp_path / "calibrated.yaml"
    save_cluster(fitted, path)
    again = load_cluster(str(path))
    assert again == fitted
    est = estimate(again, "all_reduce", 2, 1 << 18)
    assert est.algorithm == "ring" and est.protocol == "alpha-beta" and est.time_s > 0
