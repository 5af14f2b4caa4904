"""A configuration error in what the ranks build (a mistyped model argument) ends the job once, with
the usage exit code: torchrun does not restart into it, and `--dry-run` catches it before any start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import env_for, finish, start_train, write_spec

pytestmark = pytest.mark.multiproc


def test_a_spec_error_fails_once_and_the_dry_run_catches_it(tmp_path: Path) -> None:
    model = {"entrypoint": "gpuyard.train.examples:mlp", "kwargs": {"dropout": 0.1, "hiden": 3}}
    spec = write_spec(tmp_path, model=model, max_restarts=3, callbacks=[])
    env = env_for(tmp_path)
    dry = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "train", str(spec), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 2, dry.stderr[-2000:]
    assert "model.kwargs: got an unexpected keyword argument 'hiden'" in dry.stderr
    assert "Traceback" not in dry.stderr and "torch.distributed.run" not in dry.stdout
    code, out, err = finish(start_train(spec, env))
    assert code == 2, err[-3000:]
    # Once per rank (2 ranks), not again after each of the 3 restarts torchrun was allowed.
    assert err.count("got an unexpected keyword argument 'hiden'") <= 2, err[-3000:]
    status = json.loads(out)
    assert status["status"] == "failed" and status["config_error"] is True
    assert "hiden" in status["error"]
