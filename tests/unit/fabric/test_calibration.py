"""Calibration files: the shape-law fit, applying a calibration to a cluster, and refusing a wrong one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError
from gpuyard.fabric.calibrate import (
    Calibration,
    GemmPoint,
    apply_calibration,
    fit_gemms,
    load_calibration,
    save_calibration,
)
from gpuyard.fabric.cluster import Cluster, Device, IntraNode, Nic
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.step import ParallelConfig, comm_time, estimate_step

pytestmark = pytest.mark.unit


def _law(
    m: int, n: int, k: int, peak: float = 0.2, halves: tuple[float, float, float] = (16, 64, 128)
) -> float:
    hm, hn, hk = halves
    return peak * m / (m + hm) * n / (n + hn) * k / (k + hk)


def test_the_gemm_fit_recovers_the_law_it_is_given() -> None:
    shapes = [(d, d, d) for d in (64, 256, 1024)] + [(64, 1024, 1024), (1024, 64, 1024), (1024, 1024, 64)]
    points = [GemmPoint(dtype="float32", m=m, n=n, k=k, tflops=_law(m, n, k)) for m, n, k in shapes]
    fit = fit_gemms(points)["float32"]
    assert (fit.half_m, fit.half_n, fit.half_k) == (16, 64, 128)
    assert fit.peak_tflops == pytest.approx(0.2, rel=1e-6) and fit.max_error < 1e-6
    capped = fit_gemms(points, {"float32": 0.1})["float32"]
    assert capped.peak_tflops == 0.1  # never above the datasheet


def _cpu_cluster() -> Cluster:
    return Cluster(
        name="local",
        accelerator="custom",
        device=Device(name="cpu (test)", memory_bytes=8 << 30, memory_bw_GBps=20, bf16_tflops=0.4),
        gpus_per_node=1,
        nodes=1,
        intra=IntraNode(kind="loopback", bw_GBps=10, latency_us=20),
        nic=Nic(count=0, gbps=1, kind="loopback", latency_us=10, gpudirect_rdma=False),
    )


def _calibration(**over: object) -> Calibration:
    doc: dict[str, object] = {
        "created": "2026-11-24T00:00:00+00:00",
        "host": "test",
        "device_kind": "cpu",
        "device_name": "Test CPU",
        "accelerator": "custom",
        "ranks": 2,
        "threads_per_rank": 1,
        "backend": "gloo",
        "gemm": [],
        "gemm_fit": {
            "float32": {
                "peak_tflops": 0.09,
                "half_m": 8,
                "half_n": 16,
                "half_k": 32,
                "median_error": 0.05,
                "max_error": 0.1,
            }
        },
        "attention_tflops": 0.04,
        "attention_efficiency": 0.44,
        "memory_bw_GBps": 30.0,
        "elementwise_GBps": 7.0,
        "op_overhead_us": 2.0,
        "overlap_slowdown": 0.9,
        "links": {
            "all_reduce": {"hop_us": 100.0, "bw_GBps": 1.5},
            "all_gather": {"hop_us": 400.0, "bw_GBps": 0.8},
        },
        **over,
    }
    return Calibration.model_validate(doc)


def test_a_cpu_calibration_makes_each_rank_a_device_with_its_measured_share() -> None:
    cluster = apply_calibration(_cpu_cluster(), _calibration())
    assert cluster.gpus_per_node == 2 and cluster.device is not None
    assert cluster.memory_bw_GBps == 7.0  # the memory-bound operators as they ran, not the streaming add
    assert cluster.compute.gemm_half == (8, 16, 32) and not cluster.compute.async_dispatch
    assert cluster.compute.overlap_slowdown == 0.9
    assert cluster.compute.efficiency("fp32") == pytest.approx(0.09 / cluster.peak_for("fp32"))
    # Measured per-op links replace the model for groups inside the node.
    size = 64 << 20
    expected = 2 * 100e-6 + size * 1.0 / 1.5e9  # all_reduce on 2 ranks: 2(n-1) hops, busbw factor 1
    assert comm_time(cluster, "all_reduce", size, 2) == pytest.approx(expected)
    assert comm_time(cluster, "all_gather", size, 2) == pytest.approx(400e-6 + size * 0.5 / 0.8e9)


def test_a_slower_calibration_predicts_a_slower_step() -> None:
    model = ModelSpec("t", 4, 256, 4, 4, 1024, 256, 128)
    cfg = ParallelConfig(dp=2, micro_batch=16, precision="fp32", stack="gpuyard")
    fast = apply_calibration(_cpu_cluster(), _calibration())
    slow_fit = {
        "float32": {
            "peak_tflops": 0.045,
            "half_m": 8,
            "half_n": 16,
            "half_k": 32,
            "median_error": 0,
            "max_error": 0,
        }
    }
    slow = apply_calibration(_cpu_cluster(), _calibration(gemm_fit=slow_fit))
    t_fast = estimate_step(model, fast, 2, 32, 128, cfg).step_time_s
    t_slow = estimate_step(model, slow, 2, 32, 128, cfg).step_time_s
    assert t_slow > 1.3 * t_fast


def test_a_calibration_from_another_device_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"measured on CPU ranks.*dgx-h100"):
        apply_calibration(load_cluster("dgx-h100"), _calibration())
    fit = {
        "peak_tflops": 720,
        "half_m": 32,
        "half_n": 64,
        "half_k": 192,
        "median_error": 0.03,
        "max_error": 0.1,
    }
    gpu = _calibration(
        device_kind="cuda",
        device_name="NVIDIA H100 80GB HBM3",
        accelerator="H100-SXM5-80GB",
        gemm_fit={"bfloat16": fit},
    )
    with pytest.raises(ConfigError, match=r"measured on H100-SXM5-80GB.*A100"):
        apply_calibration(load_cluster("dgx-a100"), gpu)
    h100 = apply_calibration(load_cluster("dgx-h100"), gpu)
    assert h100.accelerator == "H100-SXM5-80GB" and h100.compute.gemm_efficiency == pytest.approx(720 / 989.5)
    with pytest.raises(ConfigError, match="no bfloat16 GEMM"):
        apply_calibration(
            load_cluster("dgx-h100"), _calibration(device_kind="cuda", accelerator="H100-SXM5-80GB")
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "cannot read calibration file"),
        ('{"format": "other"}', "is not a gpuyard calibration file"),
        ('{"format": "gpuyard-calibration/1", "ranks": 0}', "field"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_calibration(path)


def test_cli_refuses_a_mismatched_calibration_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cpu.json"
    save_calibration(_calibration(), path)
    assert json.loads(path.read_text())["format"] == "gpuyard-calibration/1"
    trace = tmp_path / "trace.csv"
    trace.write_text("submit_time,duration,num_gpus\n0,60,1\n")
    for cmd in (
        [
            "plan",
            "--model",
            "llama3-8b",
            "--cluster",
            "dgx-h100",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--calibration",
            str(path),
        ],
        ["sim", "--trace", str(trace), "--nodes", "1", "--cluster", "dgx-h100", "--calibration", str(path)],
    ):
        with pytest.raises(SystemExit) as info:
            main(cmd)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "does not match the cluster: it was measured on CPU ranks" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--backend", "nccl", "--nproc", "2"], "--backend nccl needs CUDA GPUs"),
        (["--backend", "mpi"], "backend must be auto, gloo or nccl"),
        (["--out", "/nonexistent-gpuyard/dir/cal.json"], "does not exist"),
    ],
)
def test_calibrate_refuses_bad_options_before_measuring(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if "nccl" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid choice here")
    cmd = ["fabric", "calibrate", "--quick", *args]
    if "--out" not in args:
        cmd += ["--out", str(tmp_path / "cal.json")]
    with pytest.raises(SystemExit) as info:
        main(cmd)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cal.json").exists()
