"""Every parallel strategy on gloo (2 ranks; dp x tp with 4): same weights as one process, exact resume."""

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


def test_fsdp_with_tensor_parallel_on_a_2d_mesh(tmp_path: Path) -> None:
    """dp=2 x tp=2 (4 ranks): FSDP2 over tensor-parallel blocks matches one process and resumes exactly."""
    for found in (r["fsdp_tp"] for r in _run_job(tmp_path, 4)):
        assert found["steps"] == 6 and found["vs_reference"] < 1e-5
        assert found["val_loss_vs_reference"] < 1e-5
        assert found["resumed_from"] == "step-000000003" and found["resume_vs_whole"] <= 1e-6
