"""Predicted start and end: run times from their sources, and the queue run forward (no database)."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest

from gpuyard.scheduler.eta import (
    HORIZON_S,
    History,
    LikeRuns,
    LiveJob,
    RunTime,
    end_of,
    estimate_run_time,
    forecast,
    replay_starts,
)
from gpuyard.scheduler.placement import uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.simulator import SimConfig
from gpuyard.scheduler.trace import TraceJob

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
FIFO = partial(make_policy, "fifo")


def _known(seconds: float) -> RunTime:
    return RunTime(seconds, seconds, seconds, "history")


def test_step_model_comes_first_and_spans_its_error() -> None:
    rt = estimate_run_time(7200.0, LikeRuns((100.0,)), steps=1000, step_s=2.0)
    assert rt.basis == "step_model"
    assert rt.point == 2000.0
    assert rt.low is not None and rt.high is not None and rt.low < 2000.0 < rt.high


def test_history_median_and_range_capped_by_the_limit() -> None:
    like = LikeRuns((100.0, 200.0, 300.0, 400.0, 5000.0))
    rt = estimate_run_time(None, like)
    assert (rt.basis, rt.point) == ("history", 300.0)
    assert rt.low is not None and rt.high is not None and rt.low < 300.0 < rt.high
    capped = estimate_run_time(600.0, like)
    assert capped.high == 600.0 and capped.point == 300.0


def test_time_limit_is_an_upper_bound_and_nothing_is_unknown() -> None:
    rt = estimate_run_time(3600.0, None)
    assert (rt.basis, rt.point, rt.high) == ("time_limit", 3600.0, 3600.0)
    assert rt.low == pytest.approx(360.0)
    none = estimate_run_time(None, None)
    assert none.basis == "unknown" and none.point is None and not none.known


def test_expected_restarts_lengthen_the_run() -> None:
    calm = estimate_run_time(3600.0, LikeRuns((), (0, 0)))
    flaky = estimate_run_time(3600.0, LikeRuns((), (2, 2)))
    cfg = SimConfig()
    assert flaky.point == pytest.approx(
        calm.point + 2 * (cfg.restart_overhead_s + cfg.checkpoint_interval_s / 2)
    )


def test_history_from_rows_groups_by_user_and_name() -> None:
    class Row:
        def __init__(self, user: str, name: str, s: float, failures: int = 0) -> None:
            self.user, self.name, self.attained_s, self.failures, self.preemptions = (
                user,
                name,
                s,
                failures,
                0,
            )

    h = History.from_rows(
        [Row("ann", "a", 10.0), Row("ann", "a", 30.0, 1), Row("bob", "a", 99.0), Row("x", "y", 0)]
    )
    like = h.like("ann", "a")
    assert like is not None and like.durations == (10.0, 30.0) and like.mean_restarts == 0.5
    assert h.like("x", "y") is None and h.like("ann", "b") is None


def test_queued_job_starts_when_the_running_one_ends() -> None:
    nodes = uniform_cluster(1, 8)
    jobs = [
        LiveJob(1, 8, _known(3600.0), started_at=NOW - 600.0),
        LiveJob(2, 8, _known(1800.0)),
    ]
    got = forecast(jobs, nodes, FIFO, NOW)
    assert got[1].start == NOW - 600.0 and got[1].end == pytest.approx(NOW + 3000.0)
    assert got[2].start == pytest.approx(NOW + 3000.0)
    assert got[2].end == pytest.approx(NOW + 4800.0)
    assert got[2].basis == "history"


def test_a_free_cluster_starts_a_queued_job_now() -> None:
    got = forecast([LiveJob(5, 2, _known(60.0))], uniform_cluster(1, 8), FIFO, NOW)
    assert got[5].start == NOW and got[5].end == pytest.approx(NOW + 60.0)


def test_ranges_follow_the_run_time_spread() -> None:
    spread = RunTime(3600.0, 1800.0, 7200.0, "history")
    jobs = [LiveJob(1, 8, spread, started_at=NOW), LiveJob(2, 8, _known(60.0))]
    got = forecast(jobs, uniform_cluster(1, 8), FIFO, NOW)[2]
    assert got.start_range == (pytest.approx(NOW + 1800.0), pytest.approx(NOW + 7200.0))
    assert got.start == pytest.approx(NOW + 3600.0)


def test_unknown_run_time_gives_no_made_up_point() -> None:
    jobs = [
        LiveJob(1, 8, RunTime.unknown("nothing known"), started_at=NOW - 10.0),
        LiveJob(2, 8, _known(60.0)),
        LiveJob(3, 0, _known(60.0)),
    ]
    got = forecast(jobs, uniform_cluster(1, 8), FIFO, NOW)
    assert got[1].end is None and got[1].end_range == (None, None) and got[1].basis == "unknown"
    # Behind it: no point start and no upper bound; it may start as soon as the other ends.
    assert got[2].start is None and got[2].start_range[1] is None
    assert got[2].start_range[0] is not None and got[2].start_range[0] < NOW + 60.0
    assert "unknown run time" in got[2].note
    assert got[3].start is None and got[3].note.startswith("CPU-only")


def test_backfill_starts_a_short_job_ahead_of_a_blocked_one() -> None:
    nodes = uniform_cluster(1, 8)
    jobs = [
        LiveJob(1, 6, _known(3600.0), started_at=NOW),
        LiveJob(2, 8, _known(600.0)),  # blocked until job 1 ends
        LiveJob(3, 2, _known(600.0)),  # fits beside job 1
    ]
    fifo = forecast(jobs, nodes, FIFO, NOW)
    assert fifo[3].start == pytest.approx(NOW + 3600.0 + 600.0)  # FIFO: the head blocks it
    easy = forecast(jobs, nodes, partial(make_policy, "fifo-backfill"), NOW)
    assert easy[3].start == NOW and easy[2].start == pytest.approx(NOW + 3600.0)


def test_end_of_charges_a_preempted_attempt_as_the_simulator_does() -> None:
    cfg = SimConfig(checkpoint_interval_s=600.0, restart_overhead_s=60.0)
    # Ran 1,000 s: keeps 600 s of work (its last checkpoint); then restart overhead and the rest.
    assert end_of([[0.0, 1000.0], [2000.0, float("nan")]], 1500.0, cfg) == 2000.0 + 60.0 + 900.0
    assert end_of([[5.0, float("nan")]], 100.0, cfg) == 105.0


def test_replay_records_each_start() -> None:
    trace = [TraceJob(0, 0.0, 100.0, 8), TraceJob(1, 0.0, 50.0, 8), TraceJob(2, 10.0, 5.0, 4)]
    attempts = replay_starts(trace, uniform_cluster(1, 8), make_policy("fifo"))
    assert {k: v[0][0] for k, v in attempts.items()} == {0: 0.0, 1: 100.0, 2: 150.0}
    assert HORIZON_S > 1e8


class _FakeService:
    """What a Forecaster reads of a job service, without a store: nodes, config, fabric placer."""

    def __init__(self, nodes: list, placer: object) -> None:  # type: ignore[type-arg]
        from gpuyard.scheduler.service import ServiceConfig

        self.nodes, self.placer, self.config = nodes, placer, ServiceConfig()


def test_whatif_compares_shapes_by_the_step_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuyard.fabric.presets import load_cluster
    from gpuyard.scheduler.eta import Forecaster, whatif_counts
    from gpuyard.scheduler.fabric_placement import FabricPlacer
    from gpuyard.scheduler.nodes import nodes_from_fabric
    from gpuyard.scheduler.spec import parse_spec

    fabric = load_cluster("dgx-a100")
    nodes = nodes_from_fabric(fabric, 2)
    service = _FakeService(nodes, FabricPlacer(fabric))
    forecaster = Forecaster(service)
    # 4 GPUs of node 0 are busy for another hour: 8 GPUs fit node 1 now, 16 wait for that hour.
    busy = LiveJob(1, 4, _known(3600.0), started_at=NOW)
    monkeypatch.setattr(forecaster, "_live", lambda now: ([busy], History(), Counter()))
    small = {"layers": 8, "hidden": 2048, "heads": 16, "ffn_hidden": 8192, "vocab": 32000, "seq_len": 2048}
    workload = {"model": small, "global_batch": 64, "steps": 500}
    spec = parse_spec({"name": "w", "command": ["true"], "resources": {"gpus": 8}, "workload": workload})
    assert whatif_counts(8, 16) == [4, 8, 16]
    shapes = {s["gpus"]: s for s in forecaster.whatif(spec, [8, 16], now=NOW)}
    one, two = shapes[8], shapes[16]
    assert one["basis"] == two["basis"] == "step_model"
    assert one["shape"] == "one node" and two["shape"].startswith("2 nodes")
    assert one["start"] == "1970-01-12T13:46:40+00:00"  # NOW: starts at once
    assert two["start"] == "1970-01-12T14:46:40+00:00"  # NOW + 1 h: after the busy job
    assert one["end"] != two["end"] and one["end_range"][0] < one["end"] < one["end_range"][1]


def test_whatif_without_a_step_model_gives_other_counts_no_end(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuyard.scheduler.eta import Forecaster
    from gpuyard.scheduler.spec import parse_spec

    forecaster = Forecaster(_FakeService(uniform_cluster(2, 8), None))
    like = History({("ann", "w"): LikeRuns((600.0, 900.0))})
    monkeypatch.setattr(forecaster, "_live", lambda now: ([], like, Counter()))
    spec = parse_spec({"name": "w", "user": "ann", "command": ["true"], "resources": {"gpus": 8}})
    shapes = {s["gpus"]: s for s in forecaster.whatif(spec, [4, 8], now=NOW)}
    assert shapes[8]["basis"] == "history" and shapes[8]["end"] is not None
    assert shapes[4]["basis"] == "unknown" and shapes[4]["end"] is None and shapes[4]["start"] is not None


def test_a_forecast_under_way_serves_the_last_one_and_a_change_recomputes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuyard.scheduler.eta import Forecaster

    forecaster = Forecaster(_FakeService(uniform_cluster(1, 8), None))
    version = ["v1"]
    monkeypatch.setattr(forecaster, "_version", lambda now: version[0])
    jobs = [LiveJob(1, 8, _known(600.0), started_at=NOW), LiveJob(2, 8, _known(60.0))]
    monkeypatch.setattr(forecaster, "_live", lambda now: (jobs, History(), Counter()))
    first = forecaster.predictions(now=NOW)
    assert first[2].start == pytest.approx(NOW + 600.0)
    assert forecaster.predictions(now=NOW) is first  # same queue: the cache
    version[0] = "v2"
    jobs = [LiveJob(2, 8, _known(60.0))]  # the running job ended
    with forecaster._lock:  # another request is computing the new forecast
        assert forecaster.predictions(now=NOW) is first
    fresh = forecaster.predictions(now=NOW)
    assert fresh is not first and fresh[2].start == NOW


# -- shares, MIG slices and GPU types: placed as the server places them ----------------------------


def _share_record(node: str, gpu: int, fraction: float) -> dict:  # type: ignore[type-arg]
    """A running share's placement record, as the server writes it (placement.record_part)."""
    from gpuyard.scheduler.placement import GpuShare, SharePart, record_part

    part = SharePart(0, gpu, fraction, 0.0)
    assert GpuShare(fraction=fraction).fraction == fraction
    return {"nodes": [record_part(node, (gpu,), 0, [part])]}


def test_a_queued_share_is_forecast_and_takes_the_free_gpu_beside_a_whole_gpu_job() -> None:
    from gpuyard.scheduler.eta import held_placement
    from gpuyard.scheduler.placement import GpuShare

    nodes = uniform_cluster(1, 2)
    whole = held_placement({"nodes": [{"node": "node0000", "gpus": [0], "cpus": 0}]}, nodes)
    jobs = [
        LiveJob(1, 1, _known(3600.0), started_at=NOW, placement=whole),
        LiveJob(2, 0, _known(600.0), share=GpuShare(fraction=0.5)),
        LiveJob(3, 0, _known(600.0), share=GpuShare(fraction=0.5)),
        LiveJob(4, 0, _known(60.0), share=GpuShare(fraction=0.75)),
    ]
    got = forecast(jobs, nodes, FIFO, NOW)
    # Two halves share GPU 1 at once; the 0.75 share waits for one of them (GPU 0 is held whole).
    assert got[2].start == NOW and got[2].end == pytest.approx(NOW + 600.0)
    assert got[3].start == NOW
    assert got[4].start == pytest.approx(NOW + 600.0) and got[4].end == pytest.approx(NOW + 660.0)


def test_running_shares_hold_their_gpus_where_their_records_say() -> None:
    from gpuyard.scheduler.eta import held_placement
    from gpuyard.scheduler.placement import GpuShare

    nodes = uniform_cluster(1, 2)
    # Two quarter shares, one on each GPU (the packing policy would have put both on one GPU).
    a = held_placement(_share_record("node0000", 0, 0.25), nodes)
    b = held_placement(_share_record("node0000", 1, 0.25), nodes)
    assert a is not None and a.parts[0].gpu == 0 and b is not None and b.parts[0].gpu == 1
    quarter = GpuShare(fraction=0.25)
    jobs = [
        LiveJob(1, 0, _known(600.0), started_at=NOW, share=quarter, placement=a),
        LiveJob(2, 0, _known(1800.0), started_at=NOW, share=quarter, placement=b),
        LiveJob(3, 1, _known(60.0)),  # a whole GPU: free when the first share ends
        LiveJob(4, 2, _known(60.0)),  # both whole: after the second share, and job 3
    ]
    got = forecast(jobs, nodes, FIFO, NOW)
    assert got[1].end == pytest.approx(NOW + 600.0) and got[2].end == pytest.approx(NOW + 1800.0)
    assert got[3].start == pytest.approx(NOW + 600.0)
    assert got[4].start == pytest.approx(NOW + 1800.0)


def test_mig_slices_are_forecast_slice_by_slice_and_never_as_whole_gpus() -> None:
    from gpuyard.scheduler.eta import held_placement
    from gpuyard.scheduler.placement import GpuShare, MigSlice, NodeSpec

    slices = (MigSlice(0, "3g.40gb", "MIG-a"), MigSlice(0, "3g.40gb", "MIG-b"))
    nodes = [NodeSpec("n0", 2, "A100-80GB", gpu_memory_gb=80.0, mig_mode=(0,), mig=slices)]
    record = {
        "nodes": [
            {"node": "n0", "gpus": [], "cpus": 0, "mig": [{"gpu": 0, "profile": "3g.40gb", "uuid": "MIG-a"}]}
        ]
    }
    held = held_placement(record, nodes)
    mig = GpuShare(mig="3g.40gb")
    jobs = [
        LiveJob(1, 0, _known(600.0), started_at=NOW, share=mig, placement=held),
        LiveJob(2, 0, _known(300.0), share=mig),  # the other slice: now
        LiveJob(4, 1, _known(60.0)),  # GPU 1, the one not in MIG mode: now
        LiveJob(3, 0, _known(300.0), share=mig),  # the first slice to free: job 2's, at +300
        LiveJob(5, 2, _known(60.0)),  # GPU 0 is never whole
        LiveJob(6, 0, _known(60.0), share=GpuShare(mig="1g.10gb")),
    ]
    got = forecast(jobs, nodes, FIFO, NOW)
    assert got[2].start == NOW and got[4].start == NOW
    assert got[3].start == pytest.approx(NOW + 300.0) and got[3].end == pytest.approx(NOW + 600.0)
    assert got[5].start is None and got[5].note == "asks for 2 GPUs, more than the cluster's 1"
    assert got[6].start is None and got[6].note.startswith("resources.mig: no GPU here has a 1g.10gb slice")


def _typed_nodes() -> list:  # type: ignore[type-arg]
    from gpuyard.scheduler.placement import NodeSpec

    return [NodeSpec("a0", 8, "A100", leaf="l0"), NodeSpec("h0", 8, "H100", leaf="l0")]


def test_a_typed_job_waits_for_its_type_not_for_any_free_gpu() -> None:
    from gpuyard.scheduler.eta import held_placement

    nodes = _typed_nodes()
    on_h100 = held_placement({"nodes": [{"node": "h0", "gpus": list(range(8)), "cpus": 0}]}, nodes)
    jobs = [
        LiveJob(1, 8, _known(3600.0), started_at=NOW, gpu_type="H100", placement=on_h100),
        LiveJob(2, 8, _known(600.0), gpu_type="H100"),  # the A100 node is free, and not its type
        LiveJob(3, 4, _known(600.0), gpu_type="A100"),
        LiveJob(4, 16, _known(60.0), gpu_type="H100"),
        LiveJob(5, 4, _known(60.0), gpu_type="MI300X"),
    ]
    got = forecast(jobs, nodes, partial(make_policy, "fifo-backfill"), NOW)
    assert got[2].start == pytest.approx(NOW + 3600.0)
    assert got[3].start == NOW
    assert got[4].start is None and got[4].note == "asks for 16 H100 GPUs, more than the cluster's 8"
    assert got[5].start is None and got[5].note == "asks for 4 MI300X GPUs, more than the cluster's 0"


def test_running_jobs_hold_their_recorded_nodes_and_an_unknown_node_is_placed_anew() -> None:
    from gpuyard.scheduler.eta import held_placement

    nodes = _typed_nodes()
    record = {"nodes": [{"node": "a0", "gpus": [0, 1], "cpus": 0}, {"node": "h0", "gpus": [3], "cpus": 0}]}
    held = held_placement(record, nodes)
    assert held is not None and held.nodes == ((0, 2), (1, 1)) and held.gpus == 3
    assert held_placement({"nodes": [{"node": "gone", "gpus": [0]}]}, nodes) is None
    assert held_placement({"nodes": [{"gpus": [0]}]}, nodes) is None  # no node: not a record
    assert held_placement({"nodes": "a0"}, nodes) is None
    assert held_placement(None, nodes) is None
    # A GPU the node no longer has (a stale record): placed anew, never an index out of range.
    assert held_placement(_share_record("h0", 8, 0.5), nodes) is None
    assert held_placement(_share_record("h0", -1, 0.5), nodes) is None
    # An untyped job held on the H100 node keeps the typed one waiting; placed anew it would have
    # gone to the A100 node (the first best fit), and the typed job would start at once.
    whole_h = held_placement({"nodes": [{"node": "h0", "gpus": list(range(8)), "cpus": 0}]}, nodes)
    jobs = [
        LiveJob(1, 8, _known(900.0), started_at=NOW, placement=whole_h),
        LiveJob(2, 8, _known(60.0), gpu_type="H100"),
    ]
    assert forecast(jobs, nodes, FIFO, NOW)[2].start == pytest.approx(NOW + 900.0)


def test_whatif_of_a_typed_spec_waits_for_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuyard.scheduler.eta import Forecaster, held_placement
    from gpuyard.scheduler.spec import parse_spec

    nodes = _typed_nodes()
    forecaster = Forecaster(_FakeService(nodes, None))
    on_h100 = held_placement({"nodes": [{"node": "h0", "gpus": list(range(8)), "cpus": 0}]}, nodes)
    busy = LiveJob(1, 8, _known(3600.0), started_at=NOW, gpu_type="H100", placement=on_h100)
    like = History({("ann", "w"): LikeRuns((600.0,))})
    monkeypatch.setattr(forecaster, "_live", lambda now: ([busy], like, Counter()))
    res = {"gpus": 8, "gpu_type": "H100"}
    spec = parse_spec({"name": "w", "user": "ann", "command": ["true"], "resources": res})
    (shape,) = forecaster.whatif(spec, [8], now=NOW)
    assert shape["start"] == "1970-01-12T14:46:40+00:00"  # NOW + 1 h: when the H100 node frees
    assert shape["shape"] == "one node"


def test_the_forward_run_starts_from_the_servers_packing_mix_and_drained_nodes() -> None:
    from gpuyard.scheduler.eta import Forecaster
    from gpuyard.scheduler.placement import ClusterState

    class _Service(_FakeService):
        pass

    nodes = uniform_cluster(2, 8)
    service = _Service(nodes, None)
    service.state = ClusterState(nodes)  # type: ignore[attr-defined]
    service.state.set_drained({0})  # type: ignore[attr-defined]
    build = Forecaster(service)._cluster(Counter({(0, 0, 1, 500, ()): 3}))
    state = build()
    assert state.drained.tolist() == [True, False] and state.packing == service.config.packing
    assert state is not build()  # a fresh one per forward run (each run changes its own)
    jobs = [LiveJob(1, 8, _known(600.0), started_at=NOW), LiveJob(2, 8, _known(60.0))]
    got = forecast(jobs, nodes, FIFO, NOW, cluster=build)
    assert got[2].start == pytest.approx(NOW + 600.0)  # node 0 drained: one node's GPUs for both


def test_step_model_range_holds_the_corpus_worst_error_both_ways() -> None:
    from gpuyard.scheduler.eta import STEP_MODEL_ERROR

    rt = estimate_run_time(None, None, steps=100, step_s=1.0)
    assert rt.low is not None and rt.high is not None
    # A prediction off by the worst error either way still has the true time inside its range.
    assert rt.low == pytest.approx(100.0 / (1 + STEP_MODEL_ERROR))
    assert rt.high == pytest.approx(100.0 / (1 - STEP_MODEL_ERROR))


def test_an_executor_that_runs_a_job_on_one_node_is_forecast_so() -> None:
    from gpuyard.scheduler.eta import Forecaster, held_placement

    nodes = uniform_cluster(2, 8)
    on = [
        held_placement({"nodes": [{"node": n.name, "gpus": [0, 1, 2, 3], "cpus": 0}]}, nodes) for n in nodes
    ]
    jobs = [
        LiveJob(1, 4, _known(600.0), started_at=NOW, placement=on[0]),
        LiveJob(2, 4, _known(900.0), started_at=NOW, placement=on[1]),
        LiveJob(3, 8, _known(60.0)),
        LiveJob(4, 16, _known(60.0)),
    ]
    spread = forecast(jobs, nodes, FIFO, NOW)
    assert spread[3].start == NOW and spread[4].start == pytest.approx(NOW + 900.0)
    local = forecast(jobs, nodes, FIFO, NOW, multi_node=False)  # the local executor's reach
    assert local[3].start == pytest.approx(NOW + 600.0)
    assert local[4].start is None
    assert (
        local[4].note
        == "asks for 16 GPUs, more than the cluster's 8 on one node (this executor runs a job on one node)"
    )

    class _Local:
        multi_node = False

    service = _FakeService(nodes, None)
    assert Forecaster(service)._multi_node  # no executor known: as the simulator
    service.executor = _Local()  # type: ignore[attr-defined]
    assert not Forecaster(service)._multi_node


def test_whatif_of_a_share_gives_its_one_shape_behind_the_share_holding_its_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuyard.scheduler.eta import Forecaster, held_placement
    from gpuyard.scheduler.placement import GpuShare
    from gpuyard.scheduler.spec import parse_spec

    nodes = uniform_cluster(1, 1)
    forecaster = Forecaster(_FakeService(nodes, None))
    held = held_placement(_share_record("node0000", 0, 0.75), nodes)
    busy = LiveJob(1, 0, _known(900.0), started_at=NOW, share=GpuShare(fraction=0.75), placement=held)
    like = History({("ann", "w"): LikeRuns((600.0,))})
    monkeypatch.setattr(forecaster, "_live", lambda now: ([busy], like, Counter()))
    spec = parse_spec({"name": "w", "user": "ann", "command": ["true"], "resources": {"gpus": 0.5}})
    (shape,) = forecaster.whatif(spec, [1, 2], now=NOW)  # the counts do not apply to a share
    assert shape["gpus"] == 0 and shape["shape"] == "share: 0.5 of a GPU"
    assert shape["start"] == "1970-01-12T14:01:40+00:00"  # NOW + 900 s: the 0.75 share leaves room for 0.25
    assert forecaster.largest() == 1 and forecaster.largest("H100") == 0
