"""`gpuyard fabric bench` on 2 gloo ranks: every op correct, nccl-tests columns, calibration round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.fabric.cluster import load_cluster
from gpuyard.fabric.collectives import OPS, bus_factor, estimate

pytestmark = pytest.mark.multiproc


def test_two_ranks_measure_every_op_correctly_and_calibrate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "calibrated.yaml"
    args = [
        "fabric",
        "bench",
        "--nproc",
        "2",
        "--sizes",
        "4KiB:256KiB",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--backend",
        "gloo",
        "--calibrate",
        str(path),
        "--json",
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "gloo" and doc["nproc"] == 2
    sizes = [4096 << i for i in range(7)]
    assert [(r["op"], r["size_bytes"]) for r in doc["results"]] == [(op, s) for op in OPS for s in sizes]
    for row in doc["results"]:
        assert row["correct"], row
        assert row["time_s"] > 0 and 1 <= row["iters"] <= 3
        assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * bus_factor(row["op"], 2))
    fitted = load_cluster(str(path))
    assert fitted.gpus_per_node == 2 and fitted.collective_model == "alpha-beta"
    assert fitted.intra.bw_GBps > 0 and fitted.intra.latency_us > 0
    assert doc["calibration"]["intra"]["bw_GBps"] == pytest.approx(fitted.intra.bw_GBps)
    est = estimate(fitted, "all_reduce", 2, 1 << 18)
    assert est.algorithm == "ring" and est.protocol == "alpha-beta" and est.time_s > 0
