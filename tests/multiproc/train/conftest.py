"""Helpers for multi-process training tests: write a spec, launch `gpuyard train`, wait, read weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

HERE = Path(__file__).resolve().parent


def write_spec(folder: Path, **fields: Any) -> Path:
    """A 2-rank DDP spec over a dropout MLP (24 steps, checkpoint every 4) with the test hooks."""
    doc: dict[str, Any] = {
        "name": "mp",
        "run_dir": str(folder / "run"),
        "seed": 11,
        "model": {"entrypoint": "gpuyard.train.examples:mlp", "kwargs": {"dropout": 0.1}},
        "data": {
            "train": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 256}},
            "batch_size": 16,
        },
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
        "schedule": {"kind": "warmup_cosine", "warmup_steps": 3},
        "epochs": 3,
        "clip_grad_norm": 1.0,
        "checkpoint": {"every_steps": 4, "keep": 2},
        "max_restarts": 2,
        "callbacks": ["hooks:block_for_kill", "hooks:wait_for_sigterm"],
    }
    doc.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def env_for(folder: Path, **hooks: str) -> dict[str, str]:
    """The environment of a launch: the hooks module importable, the hook settings, a small thread count."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.update({"GPUYARD_TEST_HOOK_DIR": str(folder), "OMP_NUM_THREADS": "1"})
    env.update({f"GPUYARD_TEST_HOOK_{k.upper()}": v for k, v in hooks.items()})
    return env


def start_train(spec: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`gpuyard train SPEC --nproc 2 --json ...` as a child process."""
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "train", str(spec), "--nproc", "2", "--json", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Poll until `path` exists; fail early if the job ended first, or at the deadline."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"job ended (rc={proc.returncode}) before {path.name} appeared:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str, str]:
    """Wait for the job; returns (exit code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"job did not finish within {timeout} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Model tensors of the newest complete checkpoint, read back from DCP into one dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gpuyard.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, f"no complete checkpoint in {run_dir}"
    out = run_dir.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}
