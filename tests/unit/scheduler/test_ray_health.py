"""Health checks of a Ray cluster's nodes without Ray: RayHealthMonitor over a stand-in executor that
runs each node's NodeChecker on fake hardware, as the Ray actors do on their nodes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gpuyard.hardware.checker import NodeChecker
from gpuyard.hardware.fake import FakeNvml, fake_selftest, load_description
from gpuyard.hardware.health import NodeCheckConfig
from gpuyard.scheduler.nodes import NodeStates, RayHealthMonitor
from gpuyard.scheduler.placement import NodeSpec

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parents[1] / "hardware" / "fixtures" / "h100_hgx.json"


class _Cluster:
    """Stands in for RayExecutor.check_nodes_health: a NodeChecker per node, or a node that fails."""

    def __init__(self, nodes: list[str]) -> None:
        self.fakes = {n: FakeNvml(load_description(FIXTURE)) for n in nodes}
        self.checkers: dict[str, NodeChecker] = {}
        self.broken: dict[str, str] = {}
        self.calls: list[dict[str, Any]] = []

    def check_nodes_health(
        self,
        config: NodeCheckConfig,
        busy: Mapping[str, frozenset[int]],
        selftest: Mapping[str, bool],
        timeout_s: float,
        fakes: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        self.calls.append({"busy": dict(busy), "selftest": dict(selftest), "timeout_s": timeout_s})
        out: dict[str, Any] = {}
        for node in busy:
            if node in self.broken:
                out[node] = self.broken[node]
                continue
            fake = self.fakes[node]
            checker = self.checkers.setdefault(node, NodeChecker(config, fake, fake_selftest(fake)))
            out[node] = checker.run(busy[node], selftest[node])
        return out


@pytest.fixture
def states(gpuyard_home: Path) -> NodeStates:
    from gpuyard.store import get_store

    return NodeStates(get_store())


def _monitor(states: NodeStates, cluster: _Cluster, **config: Any) -> RayHealthMonitor:
    nodes = [NodeSpec(n, 8, "H100", n, "ray") for n in cluster.fakes]
    return RayHealthMonitor(states, cluster, nodes, NodeCheckConfig(**config))


def test_each_node_is_recorded_under_its_name_and_a_fault_drains_only_its_node(states: NodeStates) -> None:
    cluster = _Cluster(["a1", "b2"])
    monitor = _monitor(states, cluster)
    cluster.fakes["b2"].inject(3, "xid", xid=79)
    out = monitor.check_nodes({"a1": {0, 1}})
    assert out["a1"]["state"] == "healthy" and out["b2"]["state"] == "drained"
    assert "GPU 3: Xid 79" in out["b2"]["reason"] and states.drained() == {"b2"}
    # A node running a job is not self-tested (Ray's device numbers are not the scheduler's); an idle
    # one is, every GPU; the wait allows each of its GPUs a self-test.
    call = cluster.calls[0]
    assert call["busy"] == {"a1": frozenset({0, 1}), "b2": frozenset()}
    assert call["selftest"] == {"a1": False, "b2": True}
    assert call["timeout_s"] == 60 + 120 * 8
    assert not monitor.results["a1"].selftests and sorted(monitor.results["b2"].selftests) == list(range(8))


def test_a_node_whose_check_does_not_answer_is_degraded_not_drained(states: NodeStates) -> None:
    cluster = _Cluster(["a1", "b2"])
    monitor = _monitor(states, cluster, checks=("nvml",))
    cluster.broken["a1"] = "no answer within 60 s"
    out = monitor.check_nodes({})
    assert out["a1"]["state"] == "degraded" and out["b2"]["state"] == "healthy"
    assert out["a1"]["reason"] == "health check did not run: no answer within 60 s"
    assert out["a1"]["last_check"]["verdict"] == "unknown"
    assert cluster.calls[0]["timeout_s"] == 60  # no self-tests: no time for them
    assert monitor.check_nodes({})["a1"]["state"] == "degraded"
    assert len(states.history("a1")) == 1  # the same trouble again is not a new event
    del cluster.broken["a1"]
    assert monitor.check_nodes({})["a1"]["state"] == "healthy"  # it answers: graded again
    # A drained node stays drained (and keeps its reason) when its check cannot run.
    states.drain("b2", "fan swap", by="root")
    cluster.broken["b2"] = "Ray reports the node is not alive"
    doc = monitor.check_nodes({})["b2"]
    assert (doc["state"], doc["reason"]) == ("drained", "fan swap")


def test_a_cluster_that_cannot_start_the_checks_degrades_every_node(states: NodeStates) -> None:
    class Down:
        def check_nodes_health(self, *args: Any) -> dict[str, Any]:
            raise ConnectionError("Ray is gone")

    nodes = [NodeSpec(n, 4, "H100", n, "ray") for n in ("a1", "b2")]
    monitor = RayHealthMonitor(states, Down(), nodes)
    out = monitor.check_nodes({})
    assert {d["state"] for d in out.values()} == {"degraded"}
    assert "Ray is gone" in out["a1"]["reason"]
    with pytest.raises(TypeError, match="check_nodes"):
        monitor.check_once()
    assert monitor.describe() == "node health of 2 Ray nodes checked every 60 s, each on its node"


def test_maybe_check_nodes_runs_a_due_round_in_a_thread(states: NodeStates) -> None:
    cluster = _Cluster(["a1"])
    now = [0.0]
    nodes = [NodeSpec("a1", 8, "H100", "a1", "ray")]
    monitor = RayHealthMonitor(states, cluster, nodes, NodeCheckConfig(interval_s=30), clock=lambda: now[0])
    assert monitor.maybe_check_nodes({"a1": {2}})
    monitor.join(10)
    assert not monitor.maybe_check_nodes({})  # not due again before interval_s
    now[0] += 30
    assert monitor.maybe_check_nodes({})
    monitor.join(10)
    assert [c["busy"]["a1"] for c in cluster.calls] == [frozenset({2}), frozenset()]
