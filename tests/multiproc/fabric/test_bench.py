"""`gpuyard fabric bench` on 2 gloo ranks: every op correct, nccl-tests columns, calibration round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.fabric.collectives import OPS, bus_factor, estimate
from gpuyard.fabric.presets import load_cluster

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


def test_under_torchrun_the_same_command_joins_the_rendezvous(tmp_path: Path) -> None:
    # What a multi-host run does (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR); here on one host.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "gpuyard.cli.main",
        "fabric",
        "bench",
        "--sizes",
        "4KiB:8KiB",
        "--ops",
        "all_reduce,send_recv",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
    ]
    env = {**os.environ, "GPUYARD_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    docs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 1, "only rank 0 prints"
    doc = docs[0]
    assert doc["nproc"] == 2 and doc["local_nproc"] == 2
    assert [(r["op"], r["size_bytes"]) for r in doc["results"]] == [
        (op, s) for op in ("all_reduce", "send_recv") for s in (4096, 8192)
    ]
    assert all(r["correct"] for r in doc["results"])
