"""The simulator with workloads: slowdowns applied to run time, both placements replayed; spec workloads."""

from __future__ import annotations

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric.placement_cost import PlacementShape, placement_cost
from gpuyard.fabric.presets import load_cluster
from gpuyard.scheduler.fabric_placement import FabricPlacer, check_workload, workload_of
from gpuyard.scheduler.nodes import nodes_from_fabric, with_network
from gpuyard.scheduler.placement import ClusterState
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import simulate
from gpuyard.scheduler.spec import parse_spec
from gpuyard.scheduler.trace import TraceJob
from gpuyard.scheduler.workloads import trace_workloads, workload_for

pytestmark = pytest.mark.unit

FABRIC = with_network(load_cluster("dgx-a100"), 1, 4.0)  # one node per leaf: two nodes span two leaves


def _trace() -> list[TraceJob]:
    # Node 0 gets jobs 0 and 1 (4 GPUs each), node 1 job 2; when job 1 ends at t=100 the 8-GPU job 3
    # finds 4 free GPUs on each node: it can only start spread over both leaves.
    return [
        TraceJob(0, 0.0, 5000.0, 4),
        TraceJob(1, 0.0, 100.0, 4),
        TraceJob(2, 0.0, 5000.0, 4),
        TraceJob(3, 50.0, 10_000.0, 8),
    ]


def test_a_spread_job_runs_longer_by_the_predicted_ratio() -> None:
    trace, nodes = _trace(), nodes_from_fabric(FABRIC, 2)
    workloads = trace_workloads(trace, seed=3)
    r = simulate(trace, nodes, make_policy("fifo"), workloads=workloads, fabric=FABRIC)
    assert r.multi_leaf_jobs == 1 and r.slowed_jobs == 1 and r.multi_node_jobs == 1
    w = workloads[3]
    ratio = (
        placement_cost(FABRIC, w, PlacementShape((4, 4), 2, 2)).step_time_s
        / placement_cost(FABRIC, w, PlacementShape((8,), 1, 1)).step_time_s
    )
    assert ratio > 1.05
    plain = simulate(trace, nodes, make_policy("fifo"))  # no workloads: run time is the trace's
    extra = (r.avg_jct_s - plain.avg_jct_s) * len(trace)
    assert extra == pytest.approx(10_000.0 * (ratio - 1), rel=1e-6)


def test_fabric_placement_replays_and_a_zero_cap_is_topology_placement() -> None:
    trace, nodes = _trace(), nodes_from_fabric(FABRIC, 2)
    workloads = trace_workloads(trace, seed=3)
    topo = simulate(trace, nodes, make_policy("sef"), workloads=workloads, fabric=FABRIC)
    zero = make_policy("sef", placer=FabricPlacer(FABRIC, max_wait_s=0.0))
    same = simulate(trace, nodes, zero, workloads=workloads, fabric=FABRIC)
    assert same.avg_jct_s == pytest.approx(topo.avg_jct_s) and same.fabric_waits == 0
    aware = simulate(
        trace, nodes, make_policy("sef", placer=FabricPlacer(FABRIC)), workloads=workloads, fabric=FABRIC
    )
    assert aware.jobs == len(trace) and aware.rejected == 0


def test_a_small_mixed_trace_on_several_leaves_finishes_under_both_placements() -> None:
    fabric = with_network(load_cluster("dgx-a100"), 2, 4.0)
    sizes = [1, 1, 2, 4, 8, 1, 16, 4, 1, 8, 12, 2]
    trace = [TraceJob(i, (i // 4) * 120.0, 300.0 + 97.0 * (i % 7) ** 2, sizes[i % 12]) for i in range(120)]
    workloads = trace_workloads(trace, seed=0)
    results = {}
    for mode in ("topology", "fabric"):
        placer = FabricPlacer(fabric) if mode == "fabric" else None
        policy = make_policy("sef", placer=placer)
        nodes = nodes_from_fabric(fabric, 6)
        results[mode] = simulate(trace, nodes, policy, workloads=workloads, fabric=fabric)
    for r in results.values():
        assert r.jobs == 120 and 0 < r.utilization <= 1 and r.multi_leaf_jobs <= r.multi_node_jobs
    assert results["fabric"].slowed_jobs <= results["topology"].slowed_jobs + results["fabric"].fabric_waits


def test_workload_assignment_is_seeded_and_sized_by_gpus() -> None:
    trace = [TraceJob(i, 0.0, 10.0, g) for i, g in enumerate([1, 2, 8, 16, 64, 128, 0])]
    a, b = trace_workloads(trace, seed=7), trace_workloads(trace, seed=7)
    assert a == b and 6 not in a  # CPU-only jobs get none
    assert a[0].model.name in ("gpt-350m", "gpt-1.3b") and a[5].model.name in ("llama3-8b", "llama3-70b")
    assert all(w.global_batch == 4 * j.gpus for j in trace if (w := a.get(j.id)))
    import random

    assert workload_for(64, random.Random(0)).seq_len == 4096


def test_simulating_workloads_needs_the_fabric() -> None:
    trace = _trace()
    with pytest.raises(ConfigError, match="fabric cluster"):
        simulate(trace, nodes_from_fabric(FABRIC, 2), make_policy("fifo"), workloads=trace_workloads(trace))


def test_job_spec_workload_presets_dimensions_and_plan_json() -> None:
    base = {"name": "w", "command": "true", "resources": {"gpus": 16}}
    spec = parse_spec({**base, "workload": {"model": "llama3-8b", "global_batch": 64, "seq_len": 4096}})
    assert spec.workload is not None and workload_of(spec.workload).model.name == "llama3-8b"
    plan_entry = {"tp": 2, "pp": 1, "dp": 8, "cp": 1, "micro_batch": 1, "step_time_s": 1.2, "mfu": 0.5}
    spec = parse_spec({**base, "workload": {"model": "llama3-8b", "global_batch": 64, "layout": plan_entry}})
    assert spec.workload is not None and workload_of(spec.workload).knobs.tp == 2
    dims = {"layers": 2, "hidden": 256, "heads": 4, "ffn_hidden": 1024, "vocab": 1000}
    spec = parse_spec({**base, "workload": {"model": dims, "global_batch": 16}})
    assert spec.workload is not None and workload_of(spec.workload).model.hidden == 256
    with pytest.raises(ConfigError, match=r"workload.layout: tp x pp x dp x cp = 4"):
        layout = {"tp": 2, "dp": 2}
        parse_spec({**base, "workload": {"model": "llama3-8b", "global_batch": 64, "layout": layout}})
    with pytest.raises(ConfigError, match=r"workload\.model.*heads"):
        parse_spec({**base, "workload": {"model": {**dims, "heads": 3}, "global_batch": 16}})
    assert parse_spec(base).workload is None


def test_submit_check_names_unknown_models_and_workloads_that_never_fit() -> None:
    state = ClusterState(nodes_from_fabric(FABRIC, 2))
    bad = parse_spec({"name": "w", "command": "true", "workload": {"model": "gpt-9", "global_batch": 8}})
    assert bad.workload is not None
    with pytest.raises(ConfigError, match=r"workload\.model: unknown model 'gpt-9'"):
        check_workload(bad.workload, 8, None, state, None)
    big = {"model": "llama3-405b", "global_batch": 8}
    huge = parse_spec({"name": "w", "command": "true", "workload": big})
    assert huge.workload is not None
    check_workload(huge.workload, 8, None, state, None)  # topology placement does not cost it
    with pytest.raises(ConfigError, match="workload: on 8 GPUs"):
        check_workload(huge.workload, 8, None, state, FabricPlacer(FABRIC))
