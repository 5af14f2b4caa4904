"""Deployments: background servers with replica processes, recorded in the store, listed, stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gpuyard.errors import ConfigError, ConflictError, NotFoundError
from gpuyard.scheduler.client import ServerUnreachable
from gpuyard.serve.deploy import deploy, list_deployments, undeploy
from gpuyard.serve.options import BatchConfig, DriftConfig, ServeOptions
from gpuyard.serve.records import get_deployment

pytestmark = pytest.mark.integration


def _gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def auth(doc: dict) -> dict[str, str]:
    """The header carrying the deployment's key (shown once, in what deploy returned)."""
    return {"Authorization": f"Bearer {doc['api_key']}"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuyard.cli.main", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )


def test_deploy_two_replicas_serve_list_and_undeploy(serve_home: Path) -> None:
    doc = deploy("mlp", ServeOptions(port=0, replicas=2, device="auto", batch=BatchConfig(max_batch=8)))
    assert doc["status"] == "running" and doc["url"].startswith("http://127.0.0.1:")
    assert doc["device"] == "cpu" and doc["pids"]["devices"] == ["cpu", "cpu"]
    replicas = doc["pids"]["replicas"]
    assert len(replicas) == 2 and all(psutil.pid_exists(p) for p in replicas)
    url = f"{doc['url']}/v1/models/mlp/predict"
    # The key is shown once: the record keeps only its hash, and shows neither.
    assert doc["api_key"].startswith("gyk_") and "key_sha256" not in get_deployment(doc["id"])["config"]
    assert doc["api_key"] not in json.dumps(get_deployment(doc["id"]))
    no_key = httpx.post(url, json={"inputs": [[0.1] * 8]}, timeout=10)
    assert no_key.status_code == 401 and "needs a key" in no_key.json()["detail"]
    with httpx.Client(timeout=10, headers=auth(doc)) as client:  # fresh connections: spread over replicas
        for _ in range(20):
            assert httpx.post(url, json={"inputs": [[0.1] * 8]}, headers=auth(doc)).status_code == 200
        text = client.get(f"{doc['url']}/metrics").text
    # Metrics aggregate every replica (prometheus multiprocess mode): all 20 answers are counted.
    line = next(x for x in text.splitlines() if x.startswith('gpuyard_serve_requests_total{code="200"'))
    assert float(line.split()[-1]) == 20
    listed = json.loads(cli("deployments", "ls", "--json").stdout)
    assert [d["id"] for d in listed] == [doc["id"]] and listed[0]["status"] == "running"
    out = cli("undeploy", str(doc["id"]), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["status"] == "stopped"
    assert _gone([doc["pids"]["server"], *replicas])
    assert list_deployments() == [] and get_deployment(doc["id"])["stopped_at"] is not None
    with pytest.raises(ConflictError, match="already stopped"):
        undeploy(str(doc["id"]))


def test_a_server_that_dies_is_marked_dead(serve_home: Path) -> None:
    doc = deploy("mlp", ServeOptions(port=0, drift=False))
    os.killpg(doc["pids"]["server"], signal.SIGKILL)
    assert _gone([doc["pids"]["server"]])
    assert [d["status"] for d in list_deployments(all_=True) if d["id"] == doc["id"]] == ["dead"]
    assert list_deployments() == []


def test_failures_are_recorded_and_named(serve_home: Path) -> None:
    with pytest.raises(NotFoundError, match="not registered"):
        deploy("nope", ServeOptions(port=0))
    # GPUs are the scheduler's to give: without a gpuyard server there is nobody to ask.
    with pytest.raises(ServerUnreachable, match=r"placed by the scheduler.*gpuyard server"):
        deploy("mlp", ServeOptions(port=0, device="cuda"))
    with pytest.raises(ConfigError, match="chosen by the scheduler"):
        deploy("mlp", ServeOptions(port=0, device="cuda:1"))
    with socket.socket() as taken:  # a port in use: the server exits, the record says so
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"(?s)exited with code 2.*cannot listen"):
            deploy("mlp", ServeOptions(port=taken.getsockname()[1], device="cpu"))
    failed = list_deployments(all_=True)[0]
    assert failed["status"] == "failed" and "exited with code" in failed["error"]
    with pytest.raises(NotFoundError, match="no active deployment"):
        undeploy("mlp")
    bad = cli("deploy", "mlp", "--replicas", "0")
    assert bad.returncode == 2 and "--replicas 0" in bad.stderr


def test_every_option_reaches_the_server(serve_home: Path) -> None:
    """The server reads its options from the record: limits and drift settings are not dropped."""
    opts = ServeOptions(
        port=0,
        device="cpu",
        max_rows=7,
        max_body_bytes=5000,
        batch=BatchConfig(max_batch=5, max_wait_ms=1.5, mode="thread"),
        drift_config=DriftConfig(window=50, min_rows=20, interval_s=0.5),
    )
    doc = deploy("mlp", opts)
    try:
        assert doc["config"]["batch"]["mode"] == "thread"
        info = httpx.get(f"{doc['url']}/v1/models/mlp", timeout=10, headers=auth(doc)).json()
        assert (info["max_rows_per_request"], info["max_body_bytes"]) == (7, 5000)
        assert (info["max_batch"], info["max_wait_ms"], info["batching"]) == (5, 1.5, "thread")
        drift = httpx.get(f"{doc['url']}/v1/models/mlp/drift", timeout=10, headers=auth(doc)).json()
        assert drift["enabled"] and drift["reason"].endswith("tests start at 20")
        too_many = httpx.post(
            f"{doc['url']}/v1/models/mlp/predict", json={"inputs": [[0.0] * 8] * 8}, headers=auth(doc)
        )
        assert too_many.status_code == 422
    finally:
        undeploy(str(doc["id"]))


def test_deploy_command_passes_batching_and_body_limit_to_the_server(serve_home: Path) -> None:
    """`gpuyard deploy --batching thread --max-body-bytes N`: recorded, and the server runs with them."""
    out = cli(
        "deploy",
        "mlp",
        "--device",
        "cpu",
        "--no-drift",
        "--batching",
        "thread",
        "--max-body-bytes",
        "4096",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    try:
        assert doc["config"]["batch"]["mode"] == "thread" and doc["config"]["max_body_bytes"] == 4096
        info = httpx.get(f"{doc['url']}/v1/models/mlp", timeout=10, headers=auth(doc)).json()
        assert (info["batching"], info["max_body_bytes"]) == ("thread", 4096)
        big = httpx.post(
            f"{doc['url']}/v1/models/mlp/predict", json={"inputs": [[0.0] * 8] * 200}, headers=auth(doc)
        )
        assert big.status_code == 413
        # The table is read through a pipe (80 columns by default): the URL must come out whole.
        assert doc["url"] in cli("deployments", "ls").stdout
    finally:
        undeploy(str(doc["id"]))
    listed = cli("deployments", "ls").stdout
    assert doc["url"] not in listed and "not shown: --all lists them" in listed
    bad = cli("deploy", "mlp", "--device", "cpu", "--batching", "threads")
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "--batching 'threads': use one of inline, thread"
    )


def test_a_language_model_deploys_as_an_openai_server_and_undeploys(serve_home: Path, tmp_path: Path) -> None:
    """`gpuyard deploy` of a registered causal LM: the deployment's server speaks the OpenAI API (its
    replica is the language-model engine, not the tensor server), is recorded running, and stops."""
    from openai import OpenAI
    from tests.integration.serve.test_llm_server import tiny_model

    from gpuyard.models.llm import register_lm

    register_lm("tinylm", tiny_model(tmp_path))
    opts = ServeOptions(port=0, device="cpu", drift=False, batch=BatchConfig(max_batch=4), engine="gpuyard")
    doc = deploy("tinylm", opts)
    assert doc["status"] == "running" and doc["model"] == "tinylm"
    assert httpx.get(f"{doc['url']}/ready", timeout=10).status_code == 200
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError, match="invalid key"):
        OpenAI(base_url=f"{doc['url']}/v1", api_key="unused", max_retries=0).models.list()
    client = OpenAI(base_url=f"{doc['url']}/v1", api_key=doc["api_key"])
    assert [m.id for m in client.models.list().data] == ["tinylm"]
    out = client.completions.create(model="tinylm", prompt="the cat", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop")
    [stopped] = undeploy(str(doc["id"]))
    assert stopped["status"] == "stopped" and _gone([doc["pids"]["server"]])
