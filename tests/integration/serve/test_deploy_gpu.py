"""GPU deployments are scheduler jobs: `gpuyard server --gpus 4` (fake GPUs) places their replicas.

Fake GPUs have no device behind them: the replicas get ``CUDA_VISIBLE_DEVICES`` from the scheduler and
run on CPU, so what is checked here is the placement (which GPUs, disjoint, freed on undeploy,
queued when full), the job's life (cancel, restart after a crash) and the record.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from tests.waiting import wait_for

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.serve.deploy import deploy, list_deployments, undeploy
from gpuyard.serve.options import ServeOptions
from gpuyard.serve.records import get_deployment
from gpuyard.serve.scheduled import Scheduling, job_state

from .conftest import free_port

pytestmark = pytest.mark.integration

# The replica job reads the model from the server's store: it runs as the server's user (single-user mode).
FAKE_GPUS = ("--gpus", "4", "--cpus", "2", "--grace", "3", "--job-user", getpass.getuser())


@pytest.fixture(scope="module")
def scheduler(serve_home: Path) -> Iterator[str]:
    """`gpuyard server --gpus 4` on the module's home; GPUYARD_SERVER points at it."""
    url = f"http://127.0.0.1:{free_port()}"
    log = open(serve_home / "scheduler.log", "wb")  # noqa: SIM115 - the server writes to it until it exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuyard.cli.main", "server", "--port", url.rsplit(":", 1)[1], *FAKE_GPUS],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GPUYARD_HOME": str(serve_home)},
    )

    def healthy() -> bool:
        assert proc.poll() is None, (serve_home / "scheduler.log").read_text()
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, 90)
    saved = os.environ["GPUYARD_SERVER"]
    os.environ["GPUYARD_SERVER"] = url
    yield url
    os.environ["GPUYARD_SERVER"] = saved
    for d in list_deployments():
        undeploy(str(d["id"]))
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _gpus(doc: dict[str, object]) -> set[int]:
    return {int(g) for g in str(doc["pids"]["gpus"]).split(",")}  # type: ignore[index]


def _predict(doc: dict[str, object], key: object = None) -> int:
    """A prediction with the deployment's key (``key``: the one deploy showed, for a re-read record)."""
    url = f"{doc['url']}/v1/models/mlp/predict"
    auth = {"Authorization": f"Bearer {key or doc['api_key']}"}
    return httpx.post(url, json={"inputs": [[0.2] * 8]}, timeout=10, headers=auth).status_code


def test_replicas_get_disjoint_gpus_from_the_scheduler_and_give_them_back(scheduler: str) -> None:
    a = deploy("mlp", ServeOptions(port=0, replicas=2, device="cuda", drift=False))
    assert a["status"] == "running" and a["job"] is not None
    assert job_state(a["job"], Scheduling()) == "running"
    assert len(_gpus(a)) == 2 and len(a["pids"]["replicas"]) == 2 and _predict(a) == 200
    assert a["pids"]["devices"] == ["cpu", "cpu"]  # fake GPUs: no CUDA device behind them
    # --device auto goes to the scheduler too, because its nodes have GPUs.
    b = deploy("mlp", ServeOptions(port=0, replicas=2, device="auto", drift=False))
    assert b["job"] is not None and _gpus(a) | _gpus(b) == {0, 1, 2, 3} and _predict(b) == 200

    # All four GPUs are taken: a third deployment waits in the queue, then gives up and says why.
    with pytest.raises(ConfigError, match=r"not placed within 2 s.*queue"):
        deploy("mlp", ServeOptions(port=0, device="cuda", drift=False), timeout_s=2)
    failed = list_deployments(all_=True)[0]
    assert failed["status"] == "failed" and job_state(failed["job"], Scheduling()) == "cancelled"
    with pytest.raises(CapacityError, match=r"largest node .* has 4 usable GPUs"):
        deploy("mlp", ServeOptions(port=0, replicas=5, device="cuda"))

    listed = subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", "deployments", "ls", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert {d["job"] for d in json.loads(listed.stdout)} == {a["job"], b["job"]}

    # Undeploy cancels the job: its processes go, its GPUs are free for the next deployment.
    undeploy(str(a["id"]))
    stopped = get_deployment(a["id"])
    assert job_state(a["job"], Scheduling()) == "cancelled" and stopped["status"] == "stopped"
    # The replica set took the cancel's SIGTERM for a preemption and said so; a stopped record must not.
    assert stopped["error"] is None
    assert wait_for(lambda: not any(psutil.pid_exists(p) for p in a["pids"]["replicas"]), 30)
    c = deploy("mlp", ServeOptions(port=0, replicas=2, device="cuda", drift=False), timeout_s=60)
    assert _gpus(c) == _gpus(a) and _predict(c) == 200
    undeploy(str(b["id"]))
    undeploy(str(c["id"]))
    assert list_deployments() == []


def _replaced(doc: dict[str, Any]) -> dict[str, Any]:
    """Wait until the deployment is running again on other processes than ``doc``'s."""

    def check() -> dict[str, Any] | None:
        d = get_deployment(doc["id"])
        return d if d["status"] == "running" and d["pids"]["server"] != doc["pids"]["server"] else None

    return wait_for(check, 90)  # type: ignore[return-value]


def test_a_replica_set_comes_back_after_a_crash_and_after_a_preemption(scheduler: str) -> None:
    doc = deploy(
        "mlp", ServeOptions(port=0, device="cuda", drift=False), scheduling=Scheduling(max_restarts=1)
    )
    os.kill(doc["pids"]["server"], signal.SIGKILL)  # a crash: the job fails and is restarted
    back = _replaced(doc)
    # The restarted replica set still takes the key deploy showed (its hash is in the record), and
    # the admin's token.
    assert back["job"] == doc["job"] and _predict(back, doc["api_key"]) == 200 and back["error"] is None
    assert _predict(back, _token()) == 200
    # SIGTERM outside a cancel (what a preemption sends): exit 75, requeued, placed again.
    os.kill(back["pids"]["server"], signal.SIGTERM)
    again = _replaced(back)
    assert again["job"] == doc["job"] and _predict(again, doc["api_key"]) == 200
    events = httpx.get(
        f"{scheduler}/jobs/{doc['job']}/events", headers={"authorization": f"Bearer {_token()}"}
    ).json()
    reasons = " | ".join(e["reason"] or "" for e in events)
    assert "restart 1 of 1" in reasons and "preempted" in reasons, reasons
    undeploy(str(doc["id"]))
    assert job_state(doc["job"], Scheduling()) == "cancelled"
    assert get_deployment(doc["id"])["status"] == "stopped"
    # The replica set told undeploy's SIGTERM from the preemption's: it exited cleanly, not "requeue me".
    events = httpx.get(
        f"{scheduler}/jobs/{doc['job']}/events", headers={"authorization": f"Bearer {_token()}"}
    ).json()
    assert "cancelled by user (exit code 0)" in events[-1]["reason"], events[-1]


def _token() -> str:
    return (Path(os.environ["GPUYARD_HOME"]) / "token").read_text().strip()


def test_a_deploy_from_another_store_is_refused_before_its_job_is_submitted(
    scheduler: str, serve_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.scheduler.client import JobClient
    from gpuyard.serve.examples import register_example
    from gpuyard.store.db import reset_store_cache

    # The server's token, but another home: the replica set the server would start could not find
    # this command's deployment record (or would find another one under the same id).
    monkeypatch.setenv("GPUYARD_TOKEN", (serve_home / "token").read_text().strip())
    monkeypatch.setenv("GPUYARD_HOME", str(tmp_path / "other"))
    reset_store_cache()
    client = JobClient(scheduler)
    try:
        register_example("mlp", "mlp", in_features=8, hidden=16, classes=3)
        jobs = client.list_jobs()
        with pytest.raises(ConfigError, match="keeps its state in another store than this command"):
            deploy("mlp", ServeOptions(port=0, device="cuda", drift=False), timeout_s=30)
        assert client.list_jobs() == jobs  # refused before anything reached the scheduler
        assert get_deployment(1)["status"] == "failed"
    finally:
        client.close()
        monkeypatch.undo()
        reset_store_cache()
