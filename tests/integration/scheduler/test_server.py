"""`gpuyard server` as a real process: HTTP API, the `gpuyard jobs` client, and kill -9 restart safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpuyard.auth import TokenAuth
from gpuyard.scheduler.client import JobClient, ServerUnreachable
from gpuyard.scheduler.spec import parse_spec

from .conftest import ServerStarter, free_port, wait_for

pytestmark = pytest.mark.integration


def _marker_job(name: str, marker: Path, seconds: float, gpus: int = 1) -> dict[str, object]:
    code = (
        "import os, sys, time; open(sys.argv[1], 'a').write(f\"start {os.environ['GPUYARD_JOB_ID']}\\n\"); "
        f"time.sleep({seconds}); print('bye')"
    )
    return {"name": name, "command": [sys.executable, "-c", code, str(marker)], "resources": {"gpus": gpus}}


def test_kill_dash_9_restart_keeps_every_job_exactly_once(server: ServerStarter, tmp_path: Path) -> None:
    proc, url = server()
    client = JobClient(url)
    marker = tmp_path / "starts.txt"
    cpu = client.submit(parse_spec({"name": "cpu", "command": ["sleep", "1"]}))["id"]
    ids = [client.submit(parse_spec(_marker_job(f"j{i}", marker, 1.2)))["id"] for i in range(3)]
    ids.append(cpu)
    wait_for(lambda: client.get(ids[0])["state"] == "running" and client.get(ids[3])["state"] == "running")
    assert [client.get(i)["state"] for i in ids[1:3]] == ["queued", "queued"]  # one fake GPU
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, url = server()
    client = JobClient(url)
    wait_for(lambda: all(client.get(i)["state"] == "succeeded" for i in ids), timeout=60, every=0.2)
    jobs = client.list_jobs()
    assert sorted(j["id"] for j in jobs) == sorted(ids)  # nothing lost, nothing duplicated
    starts = marker.read_text().split()
    assert sorted(starts[1::2]) == sorted(str(i) for i in ids[:3])  # each GPU job started exactly once
    first = client.get(ids[0])
    assert first["attempts"] == 1  # the running job was adopted, not run again
    assert any("adopted" in (e["reason"] or "") for e in client.events(ids[0]))


def test_http_api_and_cli_client(server: ServerStarter, tmp_path: Path) -> None:
    _, url = server()
    assert httpx.get(f"{url}/jobs").status_code == 401  # the API wants the token of GPUYARD_HOME
    auth = TokenAuth()
    bad = httpx.post(
        f"{url}/jobs", json={"name": "x", "command": ["true"], "resources": {"gpus": "many"}}, auth=auth
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "resources", "gpus"]
    big = httpx.post(
        f"{url}/jobs", json={"name": "x", "command": ["true"], "resources": {"gpus": 2}}, auth=auth
    )
    assert big.status_code == 422 and "at most 1" in big.json()["detail"]
    team = httpx.post(f"{url}/jobs", json={"name": "x", "command": ["true"], "team": "nobody"}, auth=auth)
    assert team.status_code == 422 and "team" in team.json()["detail"]
    assert httpx.get(f"{url}/jobs/999", auth=auth).status_code == 404

    env = {**os.environ, "GPUYARD_SERVER": url}
    cli = [sys.executable, "-m", "gpuyard.cli.main", "jobs"]
    spec = tmp_path / "job.yaml"
    spec.write_text("name: hello\nteam: research\ncommand: sh -c 'echo one; sleep 0.5; echo two'\n")
    out = subprocess.run(
        [*cli, "submit", str(spec), "--json"], env=env, capture_output=True, text=True, check=True
    )
    job = json.loads(out.stdout)
    logs = subprocess.run(
        [*cli, "logs", "-f", str(job["id"])], env=env, capture_output=True, text=True, timeout=60
    )
    assert logs.stdout.split() == ["one", "two"]
    shown = subprocess.run([*cli, "show", str(job["id"]), "--json"], env=env, capture_output=True, text=True)
    assert json.loads(shown.stdout)["state"] == "succeeded"
    listed = json.loads(
        subprocess.run([*cli, "ls", "--json"], env=env, capture_output=True, text=True).stdout
    )
    assert [j["id"] for j in listed] == [job["id"]]
    spec.write_text("name: hello\nresources: {gpus: -2}\ncommand: 'true'\n")
    refused = subprocess.run([*cli, "submit", str(spec)], env=env, capture_output=True, text=True)
    assert (
        refused.returncode == 2 and "resources.gpus" in refused.stderr and "Traceback" not in refused.stderr
    )


def test_client_says_when_no_server_answers() -> None:
    with pytest.raises(ServerUnreachable, match="gpuyard server"):
        JobClient(f"http://127.0.0.1:{free_port()}", timeout=2).list_jobs()


def test_second_server_on_the_same_store_exits_naming_the_holder(
    server: ServerStarter, gpuyard_home: Path
) -> None:
    first, _ = server()
    second = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", str(free_port())],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUYARD_HOME": str(gpuyard_home)},
        timeout=60,
    )
    assert second.returncode == 2
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"gpuyard server pid {first.pid}" in lines[0], second.stderr
    assert first.poll() is None  # the holder keeps serving
