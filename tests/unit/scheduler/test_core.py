"""The scheduling core stepped by hand: no store, no processes, no clock (each test a few ms)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuyard import exitcodes
from gpuyard.errors import ConfigError
from gpuyard.scheduler.core import (
    JobView,
    PlacedPart,
    SchedulerCore,
    StopReason,
    on_exit,
)
from gpuyard.scheduler.elastic import ElasticConfig
from gpuyard.scheduler.executors.base import ExitStatus
from gpuyard.scheduler.placement import ClusterState, NodeSpec, share_of, uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.spec import JobState, parse_spec

pytestmark = pytest.mark.unit

NOW = 100_000.0
Q, P, R = JobState.QUEUED, JobState.PREEMPTED, JobState.RUNNING


def _view(
    job_id: int,
    state: JobState = Q,
    gpus: int | dict[str, int] = 1,
    on: list[tuple[str, tuple[int, ...]]] | None = None,
    **fields: Any,
) -> JobView:
    extra = {k: fields.pop(k) for k in ("max_restarts", "train", "checkpoint_dir") if k in fields}
    resources = {"gpus": gpus, **fields.pop("resources", {})}
    run = {} if "train" in extra else {"command": ["true"]}
    spec = parse_spec({"name": f"j{job_id}", "resources": resources, **run, **extra})
    res = spec.resources
    low, high = res.gpus, res.gpus_max or res.gpus
    return JobView(
        id=job_id,
        state=state,
        name=spec.name,
        team="default",
        user="u",
        priority=0,
        gpus=fields.pop("now_gpus", low),
        spec=spec,
        sizes=tuple(range(low, high + 1)),
        submitted_at=float(job_id),
        queued_at=float(job_id),
        placement=tuple(PlacedPart(n, g) for n, g in on or ()),
        started_at=fields.pop("started_at", NOW - 3600.0 if on else None),
        share=share_of(res.model_dump()),
        **fields,
    )


def _core(nodes: list[NodeSpec], policy: str = "fifo", **elastic: Any) -> SchedulerCore:
    return SchedulerCore(nodes, make_policy(policy), elastic=ElasticConfig(**elastic))


def _held(core: SchedulerCore, views: list[JobView]) -> ClusterState:
    state = ClusterState(core.nodes)
    core.hold(state, views)
    return state


# -- exits ----------------------------------------------------------------------------------------


def test_a_failure_with_restarts_left_is_queued_again_and_counted() -> None:
    job = _view(1, R, max_restarts=2, failures=1)
    out = on_exit(job, ExitStatus(code=3))
    assert [t.to for t in out.transitions] == [Q]
    assert out.transitions[0].reason == "failed (exit code 3); restart 2 of 2"
    assert out.failures == 2 and out.preemptions == 0 and not out.sample
    last = on_exit(_view(1, R, max_restarts=2, failures=2), ExitStatus(code=3))
    assert last.state is JobState.FAILED and last.transitions[0].reason == "failed (exit code 3)"


def test_an_unrecoverable_exit_is_never_restarted() -> None:
    out = on_exit(_view(1, R, max_restarts=5), ExitStatus(code=exitcodes.UNRECOVERABLE))
    assert out.state is JobState.FAILED and "unrecoverable" in out.transitions[0].reason


def test_a_preemption_requeues_without_counting_a_failure() -> None:
    job = _view(1, R, stop=StopReason.PREEMPT, preemptions=3)
    out = on_exit(job, ExitStatus(code=exitcodes.PREEMPTED))
    assert [t.to for t in out.transitions] == [P, Q]
    assert out.preemptions == 4 and out.failures == 0
    # A job that checkpointed and asked to be resumed on its own (exit 75) is a preemption too.
    assert on_exit(_view(2, R), ExitStatus(code=exitcodes.PREEMPTED)).preemptions == 1


def test_a_cancelled_job_ends_cancelled_even_when_it_exits_cleanly() -> None:
    out = on_exit(_view(1, R, stop=StopReason.CANCEL), ExitStatus(code=0))
    assert out.state is JobState.CANCELLED and not out.sample
    assert out.transitions[0].reason == "cancelled by user (exit code 0)"
    assert on_exit(_view(1, R), ExitStatus(code=0)).sample  # a plain success is a run-time sample


def test_a_lost_process_is_requeued_and_an_untraced_end_is_not_run_again() -> None:
    lost = on_exit(_view(1, R), ExitStatus(code=None, lost=True))
    assert lost.state is Q and lost.failures == 0 and "requeued" in lost.transitions[0].reason
    untraced = on_exit(_view(1, R, max_restarts=3), ExitStatus(code=None, untraced=True))
    assert untraced.state is JobState.FAILED and "may have finished" in untraced.transitions[0].reason


def test_an_admins_cancel_past_the_restarts_is_cancelled_not_failed() -> None:
    out = on_exit(_view(1, R), ExitStatus(code=-15, cancelled=True, reason="cancelled by scancel"))
    assert out.state is JobState.CANCELLED and out.failures == 1


def test_a_full_disk_is_named_instead_of_a_signal_never_sent() -> None:
    out = on_exit(_view(1, R), ExitStatus(code=None, killed=True), full_disk="/h/jobs/1")
    why = "failed (ended, exit code not recorded: the disk at /h/jobs/1 was full)"
    assert out.transitions[0].reason == why


def test_a_resize_requeues_at_the_smallest_size_and_keeps_its_target() -> None:
    job = _view(1, R, {"min": 2, "max": 8}, stop=StopReason.RESIZE, resize_to=4, now_gpus=8)
    out = on_exit(job, ExitStatus(code=exitcodes.PREEMPTED))
    assert [t.to for t in out.transitions] == [P, Q]
    assert out.transitions[0].reason == "resized (exit code 75): restarts on 4 GPUs instead of 8"
    assert out.keep_resize and out.gpus == 2 and out.preemptions == 0


def test_a_straggler_restart_names_the_nodes_it_avoids() -> None:
    job = _view(1, R, stop=StopReason.STRAGGLER, avoid_nodes=frozenset({"n2", "n1"}))
    out = on_exit(job, ExitStatus(code=-15))
    assert out.transitions[-1].reason == "requeued to run without node n1, n2; resumes"


# -- ticks ----------------------------------------------------------------------------------------


def test_a_tick_starts_what_fits_and_says_why_the_rest_waits() -> None:
    core = _core(uniform_cluster(2, 4))
    views = [_view(1, R, 4, on=[("node0000", (0, 1, 2, 3))]), _view(2, Q, 3), _view(3, Q, 8)]
    state = _held(core, views)
    free = state.free.copy()
    plan = core.tick(views, state, NOW)
    assert [(s.job, s.placement.nodes) for s in plan.starts] == [(2, ((1, 3),))]
    assert plan.stops == [] and set(plan.waiting) == {3}
    assert plan.waiting[3].startswith("waiting for 8 GPUs: 1 whole free")
    assert (state.free == free).all()  # the cluster given is not changed


def test_a_drained_node_moves_only_preemptible_jobs_off_it_even_when_nothing_launches() -> None:
    core = _core(uniform_cluster(2, 4))
    views = [
        _view(1, R, 2, on=[("node0000", (0, 1))], train="t.yaml"),
        _view(2, R, 2, on=[("node0000", (2, 3))]),  # no checkpoint: runs to its end
        _view(3, R, 2, on=[("node0001", (0, 1))], checkpoint_dir="/ck"),
    ]
    state = _held(core, views)
    state.set_drained({0})
    plan = core.tick(views, state, NOW, launch=False)
    assert [(s.job, s.reason) for s in plan.stops] == [(1, StopReason.PREEMPT)]
    assert plan.stops[0].note == "node node0000 drained: preempted to move off it"


def test_a_preemptive_policy_plans_preemptions_with_their_reason() -> None:
    core = SchedulerCore(uniform_cluster(1, 4), make_policy("las", min_run_s=0.0))
    views = [_view(1, R, 4, on=[("node0000", (0, 1, 2, 3))], attained_s=50_000.0), _view(2, Q, 4)]
    plan = core.tick(views, _held(core, views), NOW)
    assert [(s.job, s.reason) for s in plan.stops] == [(1, StopReason.PREEMPT)]
    assert plan.stops[0].note == "preemption requested by policy las"


def test_an_elastic_job_starts_at_its_maximum_when_nothing_else_waits() -> None:
    core = _core(uniform_cluster(1, 8))
    views = [_view(1, Q, {"min": 2, "max": 6})]
    plan = core.tick(views, _held(core, views), NOW)
    assert [s.placement.gpus for s in plan.starts] == [6]
    resized = [_view(1, Q, {"min": 2, "max": 6}, resize_to=4), _view(2, Q, 8)]
    plan = core.tick(resized, _held(core, resized), NOW)  # another waits: it starts at its target
    assert [(s.job, s.placement.gpus) for s in plan.starts] == [(1, 4)]


def test_idle_gpus_grow_a_running_elastic_job_once_its_interval_is_over() -> None:
    core = _core(uniform_cluster(1, 8), interval_s=300.0)
    job = {"min": 2, "max": 8}
    late = [_view(1, R, job, on=[("node0000", (0, 1))], started_at=NOW - 400.0)]
    plan = core.tick(late, _held(core, late), NOW)
    assert [(s.job, s.reason, s.gpus) for s in plan.stops] == [(1, StopReason.RESIZE, 8)]
    assert plan.resizes == plan.stops
    soon = [_view(1, R, job, on=[("node0000", (0, 1))], started_at=NOW - 100.0)]
    assert core.tick(soon, _held(core, soon), NOW).stops == []
    off = _core(uniform_cluster(1, 8), enabled=False)
    assert off.tick(late, _held(off, late), NOW).stops == []
    # Nothing is resized while an earlier resize is still stopping a job.
    other = _view(2, R, job, on=[("node0000", (2, 3))], stop=StopReason.RESIZE, resize_to=4)
    both = [*late, other]
    assert core.tick(both, _held(core, both), NOW).stops == []


def test_an_elastic_job_shrinks_as_little_as_lets_the_first_queued_job_start() -> None:
    core = _core(uniform_cluster(1, 8), interval_s=300.0)
    views = [
        _view(1, R, {"min": 2, "max": 8}, on=[("node0000", tuple(range(8)))], now_gpus=8),
        _view(2, Q, 3),
    ]
    plan = core.tick(views, _held(core, views), NOW)
    assert [(s.job, s.reason, s.gpus) for s in plan.stops] == [(1, StopReason.RESIZE, 5)]
    assert plan.stops[0].note.startswith("shrink to let job 2 start: from 8 to 5 GPUs")
    assert plan.starts == []


def _shared(job_id: int, gpu: int, fraction: float) -> JobView:
    view = _view(job_id, R, 0, resources={"gpu_fraction": fraction})
    return JobView(
        **{**view.__dict__, "placement": (PlacedPart("n0", (gpu,), share=(fraction, 80.0 * fraction)),)}
    )


def test_fgd_keeps_a_shared_gpu_room_for_the_shapes_the_jobs_ask() -> None:
    # GPU 1 holds a 0.5 share; the jobs known ask 0.5 and 0.25. A 0.25 beside it would leave 0.25 that
    # no 0.5 can use (the fragment rises by 0.125 GPU); on the free GPU 0.75 stays, room for a 0.5.
    core = _core([NodeSpec("n0", 2, gpu_memory_gb=80.0)])
    views = [_shared(1, 1, 0.5), _view(2, Q, 0, resources={"gpu_fraction": 0.25})]
    state = _held(core, views)
    assert state.share_policy.name == "fgd-online"
    (start,) = core.tick(views, state, NOW).starts
    assert [(p.node, p.gpu, p.fraction) for p in start.placement.parts] == [(0, 0, 0.25)]
    assert start.placement.how == "0.25 GPU: a free GPU (0), shared"


def test_fgd_packs_a_share_beside_another_when_whole_gpu_jobs_need_the_free_one() -> None:
    # Now a whole-GPU job is in the mix too: opening GPU 0 would leave no GPU for it (its fragment is
    # all the free room), packing onto GPU 1 costs nothing.
    core = _core([NodeSpec("n0", 3, gpu_memory_gb=80.0)])
    whole = _view(1, R, 1, on=[("n0", (2,))])
    views = [whole, _shared(2, 1, 0.5), _view(3, Q, 0, resources={"gpu_fraction": 0.25})]
    (start,) = core.tick(views, _held(core, views), NOW).starts
    assert [(p.node, p.gpu, p.fraction) for p in start.placement.parts] == [(0, 1, 0.25)]
    assert start.placement.how == "0.25 GPU: shares GPU 1"


def test_best_fit_packing_is_the_old_rule_and_the_policy_is_a_knob() -> None:
    nodes = [NodeSpec("n0", 2, gpu_memory_gb=80.0)]
    core = _core(nodes)
    views = [_shared(1, 1, 0.5), _view(2, Q, 0, resources={"gpu_fraction": 0.25})]
    state = ClusterState(nodes, packing="bestfit")
    core.hold(state, views)
    (start,) = core.tick(views, state, NOW).starts
    assert [(p.node, p.gpu) for p in start.placement.parts] == [(0, 1)]  # the tightest GPU
    with pytest.raises(ConfigError, match="packing 'worstfit': choose one of fgd, "):
        ClusterState(nodes, packing="worstfit")


def test_a_whole_gpu_start_of_the_same_tick_keeps_a_share_off_its_gpu() -> None:
    # fifo starts the whole-GPU job first (GPU 0 at launch: the first free one); the share then sees
    # GPU 0 as taken and opens GPU 1, whatever its policy prefers.
    core = _core([NodeSpec("n0", 2, gpu_memory_gb=80.0)])
    views = [_view(1, Q, 1), _view(2, Q, 0, resources={"gpu_fraction": 0.5})]
    plan = core.tick(views, _held(core, views), NOW)
    assert [s.job for s in plan.starts] == [1, 2]
    assert plan.starts[0].placement.nodes == ((0, 1),)
    assert [p.gpu for p in plan.starts[1].placement.parts] == [1]
