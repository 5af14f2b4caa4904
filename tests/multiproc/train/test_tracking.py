"""`gpuyard train` records its run in the state store: 1 and 2 ranks, restarts, preemption, jsonl, lock.

Each job is the real command under torchrun (gloo); the test reads the runs back through `gpuyard runs`.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpuyard import exitcodes
from gpuyard.cli.main import app
from gpuyard.models.runs import metric_series
from gpuyard.tracking.files import read_metrics

from .conftest import env_for, finish, start_train, wait_for_file, write_spec

pytestmark = pytest.mark.multiproc

ONE_EPOCH_WITH_VAL = {
    "train": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 256}},
    "val": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 64, "seed": 9}},
    "batch_size": 16,
}


def _cli_json(*args: str) -> Any:
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def _steps(run_id: str, key: str = "loss") -> list[int]:
    return [step for step, _ in metric_series(run_id, [key])[key]]


def test_one_process_run_is_recorded_and_a_preempted_job_continues_it(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    spec = write_spec(
        tmp_path, name="solo", epochs=1, data=ONE_EPOCH_WITH_VAL, tracking={"experiment": "exp1"}
    )
    proc = start_train(spec, env_for(tmp_path, mode="term", step="6"), "--nproc", "1")
    wait_for_file(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)  # the scheduler preempts the job
    code, out, err = finish(proc)
    assert code == exitcodes.PREEMPTED, err[-3000:]
    run_id = json.loads(out)["run_id"]
    [run] = _cli_json("runs", "ls", "--experiment", "exp1")
    assert (run["id"], run["name"], run["kind"], run["status"]) == (run_id, "solo", "train", "preempted")
    assert _steps(run_id) == list(range(1, 8))  # stopped at step 7, every point flushed on the way out

    # The scheduler starts the job again: it resumes from step 7 and finishes the same run.
    code, out, err = finish(start_train(spec, env_for(tmp_path), "--nproc", "1"))
    assert code == 0, err[-3000:]
    assert json.loads(out)["run_id"] == run_id
    [run] = _cli_json("runs", "ls", "--experiment", "exp1")
    assert run["status"] == "finished" and run["latest"]["validation/loss"] is not None
    shown = _cli_json("runs", "show", run_id[:8])
    assert shown["series"]["loss"] == 16 and shown["series"]["validation/loss"] == 1
    params = shown["params"]
    assert (params["layout.dp"], params["world_size"], params["optimizer.lr"]) == (1, 1, 0.01)
    assert [e["step"] for e in shown["tags"]["events"] if e["event"] == "resume"] == [7]
    assert _steps(run_id) == list(range(1, 17))


def test_two_process_job_whose_rank0_is_killed_restarts_into_the_same_run(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    # 2 ranks, 24 steps, a checkpoint every 4; rank 0 (the database writer) is SIGKILLed at step 10.
    spec = write_spec(tmp_path, name="duo", callbacks=["tracking_hooks:rank0_block_for_kill"])
    proc = start_train(spec, env_for(tmp_path, step="10"))
    wait_for_file(tmp_path / "rank0.pid", proc)
    os.kill(int((tmp_path / "rank0.pid").read_text()), signal.SIGKILL)
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["status"] == "completed" and doc["step"] == 24
    [run] = _cli_json("runs", "ls", "--experiment", "duo")
    assert run["id"] == doc["run_id"] and run["status"] == "finished"
    # metrics.jsonl has steps 9 and 10 twice (before the kill, and replayed after resuming from 8) ...
    logged = [e["step"] for e in read_metrics(tmp_path / "run") if e["event"] == "metrics" and "loss" in e]
    assert logged.count(9) == 2 and logged.count(10) == 2
    # ... the database run has every step exactly once.
    assert _steps(doc["run_id"]) == list(range(1, 25))
    shown = _cli_json("runs", "show", doc["run_id"])
    assert (shown["params"]["layout.dp"], shown["params"]["world_size"]) == (2, 2)
    assert [e["step"] for e in shown["tags"]["events"] if e["event"] == "resume"] == [8]


def test_jsonl_tracking_writes_nothing_to_the_database(gpuyard_home: Path, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, name="filed", max_steps=4)
    code, out, err = finish(start_train(spec, env_for(tmp_path), "--nproc", "1", "--tracking", "jsonl"))
    assert code == 0, err[-3000:]
    assert json.loads(out)["run_id"] is None
    logged = [e["step"] for e in read_metrics(tmp_path / "run") if e["event"] == "metrics" and "loss" in e]
    assert logged == [1, 2, 3, 4]
    assert not (tmp_path / "run" / "tracking.json").exists()
    assert not (gpuyard_home / "gpuyard.db").exists()  # not even created


def test_locked_database_neither_stalls_training_nor_loses_the_run(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from gpuyard.store import get_store

    get_store()  # create and migrate the database, then hold its write lock
    lock = sqlite3.connect(gpuyard_home / "gpuyard.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        spec = write_spec(tmp_path, name="locked", epochs=1, data=ONE_EPOCH_WITH_VAL)
        proc = start_train(spec, env_for(tmp_path), "--nproc", "1")
        # status.json is written when the loop is over: all 16 steps ran while the database was locked.
        wait_for_file(tmp_path / "run" / "status.json", proc)
        assert lock.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    code, out, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "tracking database is unavailable" not in err
    [run] = _cli_json("runs", "ls", "--experiment", "locked")
    assert run["id"] == json.loads(out)["run_id"] and run["status"] == "finished"
    assert _steps(run["id"]) == list(range(1, 17))
