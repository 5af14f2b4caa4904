"""A language model deployed with vLLM: two replica processes behind gpuyard's gateway, one killed and
replaced (the record says so), then undeployed with every vLLM process gone. vLLM really runs (see
tests/integration/serve/test_llm_engines.py for when it is skipped)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.serve.test_llm_engines import VLLM_START_S, VLLM_TEST_ENV, need_vllm, tiny_chat_model
from tests.waiting import wait_for

from gpuyard.serve.deploy import deploy, undeploy
from gpuyard.serve.options import BatchConfig, ServeOptions
from gpuyard.serve.records import get_deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3000)]


def _tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_vllm_replicas_one_killed_and_replaced_then_undeployed(
    serve_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_vllm()
    for key, value in VLLM_TEST_ENV.items():  # the deployment's process and its replicas inherit it
        monkeypatch.setenv(key, value)
    from gpuyard.models.llm import register_lm

    register_lm("chatlm", tiny_chat_model(tmp_path)[0])
    opts = ServeOptions(
        port=0, replicas=2, device="cpu", drift=False, engine="vllm", batch=BatchConfig(max_batch=8)
    )
    doc = deploy("chatlm", opts, timeout_s=VLLM_START_S)
    dep = doc["id"]
    assert doc["status"] == "running" and doc["pids"]["engine"] == "vllm"
    assert get_deployment(dep)["config"]["engine"] == "vllm"
    first = list(doc["pids"]["replicas"])
    assert len(first) == 2 and all(psutil.pid_exists(p) for p in first)
    vllm_procs = [q for p in first for q in _tree(p)]
    headers = {"Authorization": f"Bearer {doc['api_key']}"}
    body = {"model": "chatlm", "prompt": "the cat", "max_tokens": 4, "temperature": 0}

    def complete() -> httpx.Response:
        return httpx.post(f"{doc['url']}/v1/completions", json=body, headers=headers, timeout=120)

    want = complete().json()["choices"][0]["text"]
    assert [complete().json()["choices"][0]["text"] for _ in range(3)] == [want] * 3
    assert httpx.post(f"{doc['url']}/v1/completions", json=body, timeout=30).status_code == 401

    os.kill(first[0], signal.SIGKILL)  # the first replica's vLLM server dies
    health = lambda: httpx.get(f"{doc['url']}/health", timeout=10).json()["replicas"]  # noqa: E731
    wait_for(lambda: not health()[0]["ready"], timeout=60)
    r = complete()  # the other replica answers meanwhile
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want

    def replaced() -> bool:
        rec = get_deployment(dep)
        note = rec["error"] or ""
        return rec["pids"]["replicas"][0] not in (None, first[0]) and "replaced by pid" in note

    wait_for(replaced, timeout=VLLM_START_S, every=1.0)
    rec = get_deployment(dep)
    assert rec["status"] == "running"
    assert rec["error"].startswith(f"replica 0 (pid {first[0]}) exited with code -9; replaced by pid")
    wait_for(lambda: health()[0]["ready"], timeout=60)
    assert complete().json()["choices"][0]["text"] == want
    second = list(rec["pids"]["replicas"])
    vllm_procs += _tree(second[0])

    [stopped] = undeploy(str(dep))
    assert stopped["status"] == "stopped"
    # Every vLLM process (servers, engine cores, workers; the killed one's orphans too) is gone.
    wait_for(lambda: not any(_running(p) for p in vllm_procs), timeout=120)
