"""`gpuyard fabric calibrate` on 2 gloo ranks: a file the planner takes, with figures that hold together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.fabric.calibrate import apply_calibration, load_calibration
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, estimate_step

pytestmark = pytest.mark.multiproc


def test_calibrate_two_cpu_ranks_then_plan_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration.json"
    with pytest.raises(SystemExit) as info:
        main(["fabric", "calibrate", "--quick", "--nproc", "2", "--backend", "gloo", "--out", str(out)])
    assert info.value.code == 0, capsys.readouterr().err
    assert f"written to {out}" in capsys.readouterr().out
    cal = load_calibration(out)
    assert cal.ranks == 2 and cal.device_kind == "cpu" and cal.backend == "gloo"
    fit = cal.gemm_fit["float32"]
    # The fit's error measures this machine's timing noise (other work on its cores), not the code: only
    # that it was computed is checked.
    assert 0 < fit.peak_tflops < 10 and 0 <= fit.median_error < float("inf")
    assert cal.memory_bw_GBps > 0 and cal.elementwise_GBps > 0 and cal.op_overhead_us > 0
    assert cal.overlap_slowdown is not None and 0 <= cal.overlap_slowdown <= 1
    assert {"all_reduce", "all_gather", "reduce_scatter", "send_recv"} <= set(cal.links)
    assert all(r["correct"] for r in cal.collectives)

    cluster = apply_calibration(load_cluster("local"), cal)
    assert cluster.gpus_per_node == 2
    model = ModelSpec("tiny", 2, 128, 4, 4, 512, 256, 64)
    cfg = ParallelConfig(dp=2, micro_batch=4, precision="fp32", stack="gpuyard")
    assert estimate_step(model, cluster, 2, 8, 64, cfg).step_time_s > 0

    model_file = tmp_path / "tiny.json"
    model_file.write_text(
        json.dumps(
            {
                "layers": 2,
                "hidden": 128,
                "heads": 4,
                "kv_heads": 4,
                "ffn_hidden": 512,
                "vocab": 256,
                "seq_len": 64,
            }
        )
    )
    with pytest.raises(SystemExit) as info:
        main(
            [
                "plan",
                "--model",
                str(model_file),
                "--cluster",
                "local",
                "--gpus",
                "2",
                "--global-batch",
                "8",
                "--precision",
                "fp32",
                "--calibration",
                str(out),
                "--json",
            ]
        )
    assert info.value.code == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"] == "local+calibrated" and doc["plans"][0]["step_time_s"] > 0
