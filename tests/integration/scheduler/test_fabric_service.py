"""The job service with fabric placement: a job waits for one node (said once), then starts consolidated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric.presets import load_cluster
from gpuyard.scheduler.executors.local import LocalExecutor
from gpuyard.scheduler.nodes import nodes_from_fabric, with_network
from gpuyard.scheduler.placement import NodeSpec
from gpuyard.scheduler.service import JobService, ServiceConfig
from gpuyard.scheduler.spec import parse_spec

from .conftest import wait_for

pytestmark = pytest.mark.integration

FABRIC = with_network(load_cluster("dgx-a100"), 2, 4.0)  # two nodes per leaf, a 4:1 spine
WORKLOAD = {"model": "llama3-8b", "global_batch": 32, "seq_len": 2048}


class _SpanningLocal(LocalExecutor):
    """The local executor, told it may span nodes (rank 0's slots run here): enough to test placement."""

    multi_node = True


def _nodes() -> list[NodeSpec]:
    # Nodes 0-1 under leaf 0, 2-3 under leaf 1; nodes 0 and 3 have 4 healthy GPUs each.
    nodes = nodes_from_fabric(FABRIC, 4)
    half = frozenset({4, 5, 6, 7})
    return [
        NodeSpec(n.name, n.gpus, n.gpu_type, n.nvlink_domain, n.leaf, half if i in (0, 3) else frozenset())
        for i, n in enumerate(nodes)
    ]


@pytest.fixture
def services(gpuyard_home: Path) -> Iterator[Any]:
    from gpuyard.store import get_store

    made: list[JobService] = []

    def make(**config: Any) -> JobService:
        cfg = ServiceConfig(tick_s=0.05, grace_s=1.0, min_run_s=0.0, placement="fabric", **config)
        service = JobService(get_store(), _nodes(), _SpanningLocal(gpuyard_home / "jobs"), cfg, fabric=FABRIC)
        made.append(service)
        return service

    yield make
    for service in made:
        for doc in service.list_jobs(state="running"):
            with contextlib.suppress(Exception):
                service.cancel(doc["id"])
        for doc in service.list_jobs(state="running"):
            wait_for(lambda s=service, d=doc: s.tick() or s.get(d["id"])["state"] != "running", 15)


def _submit(service: JobService, name: str, gpus: int, user: str, **extra: Any) -> int:
    spec = {"name": name, "command": "sleep 30", "resources": {"gpus": gpus}, "user": user, **extra}
    return int(service.submit(parse_spec(spec))["id"])


def test_waits_for_one_node_then_starts_consolidated(services: Any) -> None:
    service = services(max_wait_s=600.0)
    # History: the blockers' kind of job ends within a second, this user's 8-GPU jobs run for ten hours.
    service.estimator.observe("default", "ops", 8, 1.0)
    service.estimator.observe("default", "alice", 8, 36_000.0)
    blockers = [_submit(service, f"b{i}", 8, "ops") for i in range(2)]
    service.tick()
    assert [service.get(b)["state"] for b in blockers] == ["running", "running"]
    job = _submit(service, "train", 8, "alice", workload=WORKLOAD)
    for _ in range(3):
        service.tick()
    doc = service.get(job)
    assert doc["state"] == "queued" and "2 nodes over 2 leaves: predicted step" in doc["reason"]
    assert "waiting up to 600 s for one node" in doc["reason"]
    waits = [e for e in service.events(job) if e["from"] == "queued" and e["to"] == "queued"]
    assert len(waits) == 1  # recorded when the reason changes, not at every tick
    dry = service.dry_run(
        parse_spec(
            {"name": "d", "command": "true", "user": "alice", "workload": WORKLOAD, "resources": {"gpus": 8}}
        )
    )
    assert (
        dry["fabric"]["decision"] == "wait" and dry["fabric"]["step_s"] > dry["fabric"]["consolidated_step_s"]
    )
    service.cancel(blockers[0])
    doc = wait_for(lambda: service.tick() or ((d := service.get(job))["state"] == "running" and d), 20)
    predicted = doc["placement"]["predicted"]
    assert predicted["choice"] == "consolidated" and predicted["where"] == "one node"
    assert len(doc["placement"]["nodes"]) == 1 and "consolidated" in doc["placement"]["how"]


def test_spreads_at_the_cap_and_says_so(services: Any) -> None:
    service = services(max_wait_s=0.0)
    service.estimator.observe("default", "alice", 8, 36_000.0)
    blockers = [_submit(service, f"b{i}", 8, "ops") for i in range(2)]
    service.tick()
    job = _submit(service, "train", 8, "alice", workload=WORKLOAD)
    doc = wait_for(lambda: service.tick() or ((d := service.get(job))["state"] == "running" and d), 20)
    predicted = doc["placement"]["predicted"]
    assert predicted["choice"] == "spread" and predicted["step_s"] > predicted["consolidated_step_s"]
    assert len(doc["placement"]["nodes"]) == 2 and "the cap" in doc["placement"]["how"]
    assert all(service.get(b)["state"] == "running" for b in blockers)


def test_workload_errors_are_refused_at_submit(services: Any) -> None:
    service = services()
    with pytest.raises(ConfigError, match=r"workload\.model"):
        _submit(service, "bad", 8, "alice", workload={"model": "nope-1b", "global_batch": 8})
    plain = _submit(service, "plain", 4, "alice")  # no workload: placed as before
    service.tick()
    assert "predicted" not in service.get(plain)["placement"]


def test_fabric_placement_needs_the_fabric(gpuyard_home: Path) -> None:
    from gpuyard.store import get_store

    with pytest.raises(ConfigError, match="fabric cluster"):
        JobService(
            get_store(), _nodes(), _SpanningLocal(gpuyard_home / "jobs"), ServiceConfig(placement="fabric")
        )
