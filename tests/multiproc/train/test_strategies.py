"""Every parallel strategy on gloo (2 ranks; dp x tp, pp x dp and pp x tp with 4 ranks).

Each matches a single-process reference loop and resumes exactly from its sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import HERE

pytestmark = pytest.mark.multiproc

STRATEGIES = ["ddp", "fsdp", "tp", "pp_gpipe", "pp_1f1b"]


def _run_job(out: Path, nproc: int) -> list[dict[str, Any]]:
    """Run strategies_job.py under torchrun with `nproc` ranks; returns each rank's findings."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / "strategies_job.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun job (2 ranks) runs all 1-D strategies."""
    return _run_job(tmp_path_factory.mktemp("strategies"), 2)


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_matches_single_process_training(results: list[dict[str, Any]], name: str) -> None:
    for rank_result in results:
        found = rank_result[name]
        assert found["steps"] == 6
        assert found["vs_reference"] < 1e-5
        assert found["val_loss_vs_reference"] < 1e-5


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_resumes_exactly_from_sharded_checkpoint(results: list[dict[str, Any]], name: str) -> None:
    for rank_result in results:
        found = rank_result[name]
        # Stop requested on rank 0 only after step 2: all ranks agree and stop after step 3.
        assert found["stopped_at"] == 3 and found["resumed_from"] == "step-000000003"
        assert found["resumed_steps"] == 6
        assert found["resume_vs_whole"] <= 1e-6


def test_pipeline_ranks_hold_different_stages(results: list[dict[str, Any]]) -> None:
    for name in ("pp_gpipe", "pp_1f1b"):
        assert sorted(r[name]["stage"] for r in results) == [0, 1]
        # Each stage compared its own half of the 4-linear-layer MLP (2 layers x weight, bias).
        assert all(r[name]["keys"] == 4 for r in results)
    # Tensor parallel gathered the full model on each rank.
    assert results[0]["tp"]["keys"] == results[1]["tp"]["keys"] > 4


@pytest.fixture(scope="module")
def results_4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun job (4 ranks) runs the 2-D layouts: dp x tp, pp x dp (DDP and FSDP2), pp x tp."""
    return _run_job(tmp_path_factory.mktemp("strategies4"), 4)


def test_fsdp_with_tensor_parallel_on_a_2d_mesh(results_4: list[dict[str, Any]]) -> None:
    """dp=2 x tp=2 (4 ranks): FSDP2 over tensor-parallel blocks matches one process and resumes exactly."""
    for found in (r["fsdp_tp"] for r in results_4):
        assert found["steps"] == 6 and found["vs_reference"] < 1e-5
        assert found["val_loss_vs_reference"] < 1e-5
        assert found["resumed_from"] == "step-000000003" and found["resume_vs_whole"] <= 1e-6


@pytest.mark.parametrize("name", ["pp_ddp", "pp_fsdp"])
def test_pipeline_with_data_parallel_on_a_2d_mesh(results_4: list[dict[str, Any]], name: str) -> None:
    """pp=2 x dp=2: each stage replicated (DDP) or sharded (FSDP2) over its dp group.

    Matching the single-process loop over 32-sample global batches shows that the two dp replicas
    read different halves of each batch and that each stage's gradients were averaged over them
    (unsynchronised replicas, or replicas reading the same samples, would drift from the reference).
    """
    found = [r[name] for r in results_4]
    # Mesh ("pp", "dp", "tp"): ranks 0, 1 hold stage 0 (dp 0, 1), ranks 2, 3 stage 1.
    assert [(f["stage"], f["dp_rank"]) for f in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for f in found:
        assert f["keys"] == 4  # this stage's two linear layers (weight, bias), gathered whole
        assert f["steps"] == 6 and f["micro_batches_seen"] == 6  # 96 samples per dp shard / 16
        assert f["vs_reference"] < 1e-6
        assert f["val_loss_vs_reference"] < 1e-6
        assert f["stopped_at"] == 3 and f["resumed_from"] == "step-000000003"
        assert f["resumed_steps"] == 6 and f["resume_vs_whole"] <= 1e-6


def test_pipeline_with_tensor_parallel_stages(results_4: list[dict[str, Any]]) -> None:
    """pp=2 x tp=2: each stage's transformer block sharded over its tp pair, stages joined by 1F1B."""
    found = [r["pp_tp"] for r in results_4]
    # Mesh ("pp", "dp", "tp"): tp pairs are neighbouring ranks (0, 1) and (2, 3).
    assert [(f["stage"], f["tp_rank"]) for f in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for f in found:
        # One block per stage: q, k, v, fc1 (weight + bias) and out, fc2 (weight) are split on tp.
        assert f["tp_sharded_params"] == 10
        assert f["steps"] == 6 and f["vs_reference"] < 1e-6
        assert f["val_loss_vs_reference"] < 1e-6
        assert f["stopped_at"] == 3 and f["resumed_from"] == "step-000000003"
        assert f["resumed_steps"] == 6 and f["resume_vs_whole"] <= 1e-6


@pytest.fixture(scope="module")
def results_8(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun job (8 ranks) runs the 3-D layout pp x dp x tp."""
    return _run_job(tmp_path_factory.mktemp("strategies8"), 8)


def test_pipeline_data_and_tensor_parallel_in_three_dimensions(results_8: list[dict[str, Any]]) -> None:
    """pp=2 x dp=2 x tp=2 (8 ranks): FSDP2 over the dp pairs of tensor-parallel pipeline stages.

    Every rank holds one stage, one dp shard and one tp shard; together they train exactly what one
    process trains on the same global batches, and a resumed run lands on the same weights.
    """
    found = [r["pp_dp_tp"] for r in results_8]
    # Mesh ("pp", "dp", "tp"), tp innermost: rank = 4 * stage + 2 * dp_rank + tp_rank.
    assert [(f["stage"], f["dp_rank"], f["tp_rank"]) for f in found] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]
    for f in found:
        assert f["tp_sharded_params"] == 10  # one transformer block per stage, split over tp
        assert f["steps"] == 6 and f["vs_reference"] < 1e-6
        assert f["val_loss_vs_reference"] < 1e-6
        assert f["stopped_at"] == 3 and f["resumed_from"] == "step-000000003"
        assert f["resumed_steps"] == 6 and f["resume_vs_whole"] <= 1e-6
