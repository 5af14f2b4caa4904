"""`gpuyard train` under torchrun: SIGKILL of a rank -> restart -> resume; SIGTERM -> 75 -> resume; NaN -> 76.

Each interrupted run must end with the same weights as the uninterrupted reference run (1e-6):
resume restores model, optimizer, LR schedule, RNG (dropout) and the data position.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from gpuyard import exitcodes
from gpuyard.tracking.files import read_metrics

from .conftest import env_for, final_weights, finish, start_train, wait_for_file, write_spec

pytestmark = pytest.mark.multiproc


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


def test_sigkill_of_a_rank_restarts_and_resumes_from_last_checkpoint(tmp_path: Path, reference) -> None:
    spec = write_spec(tmp_path)
    proc = start_train(spec, env_for(tmp_path, mode="kill", step="10"))
    wait_for_file(tmp_path / "victim.pid", proc)
    os.kill(int((tmp_path / "victim.pid").read_text()), signal.SIGKILL)
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["status"] == "completed"
    # One summary of the restart; the ranks' tracebacks are in train.log, not on the terminal.
    log = tmp_path / "run" / "train.log"
    assert doc["notes"] == [
        f"restart 1: local rank 1 died (SIGKILL); resumed from step 8 (storage); tracebacks in {log}"
    ]
    assert "Traceback" not in err and "failed (exitcode: -9) local_rank: 1" in log.read_text()
    resumes = [e for e in read_metrics(tmp_path / "run") if e["event"] == "resume"]
    # Killed at step 10: the restarted workers resumed from the checkpoint of step 8.
    assert [e["step"] for e in resumes] == [8]
    _assert_same_weights(final_weights(tmp_path / "run"), reference)


def test_sigterm_checkpoints_exits_preempted_and_resumes_exactly(tmp_path: Path, reference) -> None:
    spec = write_spec(tmp_path)
    proc = start_train(spec, env_for(tmp_path, mode="term", step="6"))
    wait_for_file(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)  # what the scheduler does to preempt the job
    code, out, err = finish(proc)
    assert code == exitcodes.PREEMPTED, err[-3000:]
    first = json.loads(out)
    # Rank 0 waited at step 6 for the signal; the ranks agreed at step 7 and checkpointed there.
    assert first["status"] == "preempted" and first["step"] == 7
    assert first["checkpoint"].endswith("step-000000007")

    code, out, err = finish(start_train(spec, env_for(tmp_path)))
    assert code == 0, err[-3000:]
    assert json.loads(out)["step"] == 24
    assert [e["step"] for e in read_metrics(tmp_path / "run") if e["event"] == "resume"] == [7]
    _assert_same_weights(final_weights(tmp_path / "run"), reference)


def test_non_finite_loss_exits_diverged_without_restarts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, loss="hooks:nan_after_10")
    code, out, err = finish(start_train(spec, env_for(tmp_path)))
    assert code == exitcodes.DIVERGED, err[-3000:]
    doc = json.loads(out)
    assert doc["status"] == "diverged" and doc["step"] == 11
    assert doc["checkpoint"].endswith("step-000000008")  # the last good one, kept
    assert "became non-finite at step 11" in err
    # Not restarted by torchrun: one params event, no resume.
    events = read_metrics(tmp_path / "run")
    assert sum(e["event"] == "params" for e in events) == 1


def test_launcher_killed_outright_still_stops_workers_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGKILL of `gpuyard train` itself: torchrun gets SIGTERM (parent-death signal), workers checkpoint."""
    spec = write_spec(tmp_path)
    proc = start_train(spec, env_for(tmp_path, mode="term", step="6"))
    wait_for_file(tmp_path / "ready", proc)
    proc.kill()
    # torchrun and the workers inherited the output pipes: reading them to the end waits for them all.
    finish(proc)
    doc = json.loads((tmp_path / "run" / "status.json").read_text())
    assert doc["status"] == "preempted" and doc["checkpoint"].endswith("step-000000007")
