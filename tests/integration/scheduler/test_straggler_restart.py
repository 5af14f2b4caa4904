"""A straggler reported to the scheduler: an event on the job, and with ``on_straggler: restart`` a
restart without the straggler's node when another placement is free (local executor, real processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuyard.scheduler.spec import parse_spec

from .conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def two_nodes(gpuyard_home: Path) -> Iterator[Any]:
    """A job service over two 2-GPU nodes (both run here: the local executor starts every job)."""
    from gpuyard.scheduler.executors.local import LocalExecutor
    from gpuyard.scheduler.placement import NodeSpec
    from gpuyard.scheduler.service import JobService, ServiceConfig
    from gpuyard.store import get_store

    nodes = [NodeSpec(n, 2, "fake-gpu", "d" + n, "leaf", cpus=2) for n in ("a", "b")]
    service = JobService(
        get_store(), nodes, LocalExecutor(gpuyard_home / "jobs"), ServiceConfig(tick_s=0.05, grace_s=2.0)
    )
    yield service
    for doc in service.list_jobs():
        if doc["state"] in ("running", "scheduled"):
            service.cancel(doc["id"])
            wait_for(lambda d=doc: service.tick() or service.get(d["id"])["state"] == "cancelled", 10)


def _running(service: Any, job_id: int, attempt: int) -> dict[str, Any]:
    def check() -> Any:
        service.tick()
        doc = service.get(job_id)
        return doc["state"] == "running" and doc["attempts"] == attempt and doc

    return wait_for(check, 30)  # type: ignore[no-any-return]


def _report(node: str) -> dict[str, Any]:
    return {"rank": 1, "node": node, "cause": "compute", "slowdown": 1.7, "step": 30}


def test_restart_without_the_stragglers_node_then_stay_when_none_is_free(two_nodes: Any) -> None:
    service = two_nodes
    spec = {"name": "t", "command": ["sleep", "60"], "resources": {"gpus": 2}, "on_straggler": "restart"}
    job = service.submit(parse_spec(spec))["id"]
    first = _running(service, job, 1)["placement"]["nodes"][0]["node"]
    out = service.report_straggler(job, _report(first))
    assert out["restarting"] is True
    assert out["reason"].endswith(f"restarting without node {first} (checkpoint, requeue)")
    doc = _running(service, job, 2)
    other = doc["placement"]["nodes"][0]["node"]
    assert other != first and doc["avoid_nodes"] == [first] and doc["preemptions"] == 0
    reasons = [e["reason"] or "" for e in service.events(job)]
    assert any(r.startswith(f"straggler: rank 1 on node {first} is 1.70x slower") for r in reasons)
    assert any(r.startswith("stopped to move off a straggler's node") for r in reasons)
    # Now slow on the other node: no 2 GPUs are free without both nodes; it stays, and says why.
    out = service.report_straggler(job, _report(other))
    assert out["restarting"] is False
    assert out["reason"].endswith(f"not restarted: no placement of 2 GPUs without node {other} is free now")
    assert service.get(job)["stop_requested"] is None
    # A node that is not the job's is named as such.
    out = service.report_straggler(job, _report("c"))
    assert out["reason"].endswith("not restarted: node c is not one of the job's")


def test_a_job_that_did_not_ask_is_only_reported(two_nodes: Any) -> None:
    service = two_nodes
    job = service.submit(parse_spec({"name": "t", "command": ["sleep", "60"], "resources": {"gpus": 2}}))[
        "id"
    ]
    node = _running(service, job, 1)["placement"]["nodes"][0]["node"]
    out = service.report_straggler(job, _report(node))
    assert out == {
        "restarting": False,
        "reason": f"straggler: rank 1 on node {node} is 1.70x slower than the median rank (cause: compute) "
        "at step 30; reported (on_straggler: report)",
    }
    assert service.get(job)["stop_requested"] is None and service.get(job)["avoid_nodes"] == []
    assert service.events(job)[-1]["data"] == _report(node)


def test_an_elastic_job_grown_at_its_restart_keeps_off_the_avoided_node(two_nodes: Any) -> None:
    service = two_nodes
    spec = {
        "name": "el",
        "command": ["sleep", "60"],
        "resources": {"gpus": {"min": 1, "max": 2}},
        "on_straggler": "restart",
    }
    job = service.submit(parse_spec(spec))["id"]
    doc = _running(service, job, 1)
    first = doc["placement"]["nodes"][0]["node"]
    assert doc["gpus"] == 2  # nothing else waits: its maximum
    # Another job takes one GPU of the other node: restarting without the first node leaves 1 GPU.
    other = service.submit(parse_spec({"name": "o", "command": ["sleep", "60"], "resources": {"gpus": 1}}))
    wait_for(lambda: service.tick() or service.get(other["id"])["state"] == "running", 30)
    assert service.report_straggler(job, _report(first))["restarting"] is True
    doc = _running(service, job, 2)
    assert [p["node"] for p in doc["placement"]["nodes"]] != [first] and doc["gpus"] == 1
