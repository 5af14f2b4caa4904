"""Helpers for multi-process training tests: write a spec, launch `gpuyard train`, wait, read weights."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
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


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of the default spec's run (2 ranks, storage checkpoints every 4 steps), never
    interrupted: what test_fault_tolerance's and test_memory_checkpoint's interrupted runs must end
    with. Trained once per test session: the first pytest-xdist worker to ask trains it in a folder all
    workers share while it holds a lock; the others wait for the lock and read the same run."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, which holds each worker's own
    folder = shared / "multiproc-reference"
    with open(shared / "multiproc-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        done = folder / "trained"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed here left it half done
            code, out, err = finish(start_train(write_spec(folder), env_for(folder)))
            assert code == 0, err[-3000:]
            doc = json.loads(out)
            assert doc["status"] == "completed" and doc["step"] == 24
            done.touch()
        return final_weights(folder / "run")


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
