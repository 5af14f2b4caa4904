"""Predicted start and end on a running `gpuyard server`: the API's ``prediction``, `jobs ls / show`,
and `jobs whatif`, with a job of unknown run time in the way and then out of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from gpuyard.auth import TokenAuth
from gpuyard.scheduler.client import JobClient
from gpuyard.scheduler.spec import parse_spec

from .conftest import ServerStarter, wait_for

pytestmark = pytest.mark.integration


def _job(name: str, seconds: float) -> dict[str, object]:
    return {"name": name, "team": "research", "command": ["sleep", str(seconds)], "resources": {"gpus": 1}}


def test_queued_job_gets_a_prediction_through_the_api_and_the_cli(
    server: ServerStarter, tmp_path: Path
) -> None:
    _, url = server()
    client = JobClient(url)
    auth = TokenAuth()
    # History: one finished "quick" job of this user.
    done = client.submit(parse_spec(_job("quick", 0.3)))["id"]
    wait_for(lambda: client.get(done)["state"] == "succeeded", timeout=60)
    assert client.get(done)["prediction"] is None  # finished: nothing to predict
    blocker = client.submit(parse_spec(_job("blocker", 300)))["id"]  # no history: unknown run time
    wait_for(lambda: client.get(blocker)["state"] == "running", timeout=60)
    queued = client.submit(parse_spec(_job("quick", 300)))["id"]
    assert client.get(queued)["state"] == "queued"  # one GPU, held by the blocker

    docs = {d["id"]: d for d in httpx.get(f"{url}/jobs", auth=auth).json()}
    first, second = docs[blocker]["prediction"], docs[queued]["prediction"]
    assert first["basis"] == "unknown" and first["end"] is None and first["end_range"] == [None, None]
    assert first["start"] is not None  # it runs: its start is known
    # Behind a job of unknown run time: no made-up start, no upper bound, its own run time from history.
    assert second["basis"] == "history" and second["start"] is None and second["start_range"][1] is None
    assert "unknown run time" in second["note"] and "1 finished run" in second["note"]

    env = {**os.environ, "GPUYARD_SERVER": url, "COLUMNS": "250"}
    cli = [sys.executable, "-m", "gpuyard.cli.main", "jobs"]
    listed = subprocess.run([*cli, "ls"], env=env, capture_output=True, text=True, check=True).stdout
    assert "starts unknown" in listed and "ends unknown" in listed, listed
    shown = subprocess.run([*cli, "show", str(queued)], env=env, capture_output=True, text=True, check=True)
    assert "basis  history" in shown.stdout and "start  unknown" in shown.stdout, shown.stdout

    spec = tmp_path / "quick.yaml"
    spec.write_text("name: quick\nteam: research\ncommand: sleep 1\nresources: {gpus: 1}\n")
    asked = subprocess.run([*cli, "whatif", str(spec), "--json"], env=env, capture_output=True, text=True)
    assert asked.returncode == 0, asked.stderr
    shapes = json.loads(asked.stdout)["shapes"]
    assert [s["gpus"] for s in shapes] == [1]  # half is 0 and twice is more than the cluster has
    assert shapes[0]["basis"] == "history" and shapes[0]["start"] is None and shapes[0]["shape"] == "one node"
    text = subprocess.run([*cli, "whatif", str(spec)], env=env, capture_output=True, text=True, check=True)
    assert text.stdout.startswith("   1 GPUs, one node: starts unknown"), text.stdout
    assert [j["id"] for j in client.list_jobs()].count(queued) == 1 and len(client.list_jobs()) == 3
    # A GPU share is forecast as the server would place it: its GPU is the blocker's, whole.
    half = client.submit(parse_spec({**_job("half", 300), "resources": {"gpus": 0.5}}))["id"]
    doc = client.get(half)
    assert doc["state"] == "queued" and doc["prediction"]["start"] is None, doc
    assert "unknown run time" in doc["prediction"]["note"], doc["prediction"]
    client.cancel(half)

    client.cancel(blocker)  # out of the way: the queued job starts and its end is known
    wait_for(lambda: client.get(queued)["state"] == "running", timeout=60)
    doc = client.get(queued)
    pred = doc["prediction"]
    assert pred["basis"] == "history" and pred["end"] is not None
    started = datetime.fromisoformat(doc["started_at"])
    assert datetime.fromisoformat(pred["start"]) == started.replace(microsecond=0)
    assert datetime.fromisoformat(pred["end"]) >= datetime.fromisoformat(pred["start"])
    after = client.whatif(parse_spec(_job("quick", 1)))["shapes"][0]
    assert after["start"] is not None and after["end"] is not None and after["end"] >= after["start"]
    client.cancel(queued)
