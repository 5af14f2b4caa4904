"""GPU-sharing placement in the simulator: FGD's fragmentation measure on nodes where the answer is
known, FGD keeping room that best-fit fragments, the baselines, the fill experiment and the replay."""

from __future__ import annotations

import numpy as np
import pytest

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.scheduler.fragmentation import Fragmentation, TaskMix, fragmentation_rate
from gpuyard.scheduler.gpushares import SharedCluster
from gpuyard.scheduler.openb import GpuNode, GpuTask
from gpuyard.scheduler.packing import FGD, BestFit, FirstFit, RandomFit, fgd_node_score, make_packing
from gpuyard.scheduler.packing_replay import fill, inflate, replay

pytestmark = pytest.mark.unit

BIG_CPU, BIG_MEM = 64_000, 262_144


def _node(name: str, gpus: int, model: str = "T4", cpu: int = BIG_CPU, mem: int = BIG_MEM) -> GpuNode:
    return GpuNode(name, cpu, mem, gpus, model)


def _task(milli: int, num_gpu: int = 1, cpu: int = 1000, mem: int = 1024, **kw: object) -> GpuTask:
    return GpuTask(f"t{milli}x{num_gpu}", cpu, mem, num_gpu, milli, **kw)  # type: ignore[arg-type]


def _mix(*shapes: tuple[GpuTask, int]) -> TaskMix:
    return TaskMix.of([t for t, count in shapes for _ in range(count)])


def _frag(cluster: SharedCluster, mix: TaskMix) -> list[float]:
    return Fragmentation(mix, cluster).of_nodes(cluster).tolist()


def _set_room(cluster: SharedCluster, node: int, room: list[int]) -> None:
    """Use GPUs of ``node`` down to ``room`` thousandths each (through place, as tasks would)."""
    for g, left in enumerate(room):
        if left < 1000:
            cluster.place(GpuTask("used", 0, 0, 1, 1000 - left), (node, (g,)))


def test_fragment_is_the_room_too_small_for_the_shape() -> None:
    cluster = SharedCluster([_node("a", 2)])
    whole = _mix((_task(1000), 1))
    assert _frag(cluster, whole) == [0.0]  # both GPUs fit a whole-GPU task
    _set_room(cluster, 0, [500, 1000])
    assert _frag(cluster, whole) == [500.0]  # half a GPU no whole-GPU task can use
    # Half the tasks want half a GPU (both GPUs fit them), half a whole one (the half GPU is lost).
    assert _frag(cluster, _mix((_task(1000), 1), (_task(500), 1))) == [250.0]
    # A 600 share fits only the free GPU: the 500 left is a fragment for it too.
    assert _frag(cluster, _mix((_task(600), 1))) == [500.0]


def test_a_shape_that_cannot_run_on_the_node_counts_all_its_free_gpus() -> None:
    cluster = SharedCluster([_node("a", 2, cpu=4000), _node("b", 2, model="V100")])
    _set_room(cluster, 0, [700, 1000])
    assert _frag(cluster, _mix((_task(500, cpu=8000), 1))) == [1700.0, 0.0]  # CPU short on a
    assert _frag(cluster, _mix((_task(500, gpu_spec=("V100",)), 1))) == [1700.0, 0.0]  # wrong model on a
    assert _frag(cluster, _mix((_task(1000, num_gpu=2), 1))) == [1700.0, 0.0]  # two whole GPUs: only b


def test_memory_is_a_resource_of_the_shape() -> None:
    cluster = SharedCluster([_node("a", 1, mem=4096)])
    assert _frag(cluster, _mix((_task(500, mem=8192), 1))) == [1000.0]
    assert _frag(cluster, _mix((_task(500, mem=2048), 1))) == [0.0]


def test_popularity_weights_the_shapes_and_cpu_only_tasks_are_left_out() -> None:
    mix = TaskMix.of([_task(1000)] * 3 + [_task(250)] + [GpuTask("cpu", 1000, 1, 0, 0)] * 5)
    assert sorted(mix.p.tolist()) == [0.25, 0.75]
    cluster = SharedCluster([_node("a", 1), _node("b", 1)])
    _set_room(cluster, 0, [300])  # 300 left: lost to whole-GPU tasks (3/4), usable by 250 shares
    assert _frag(cluster, mix) == [225.0, 0.0]
    assert fragmentation_rate(cluster, mix) == pytest.approx(225.0 / 2000.0)
    with pytest.raises(ConfigError, match="no task asks for a GPU"):
        TaskMix.of([GpuTask("cpu", 1000, 1, 0, 0)])


def test_fgd_keeps_a_node_whole_where_best_fit_fragments_it() -> None:
    # Node a has 700 left on its GPU, node b a free GPU; the workload's shares are of 700.
    nodes = [_node("a", 1), _node("b", 1)]
    mix = _mix((_task(700), 1))
    first, later = _task(300), _task(700)
    placed = {}
    for policy in (FGD(mix), FGD(mix, score="k8s"), BestFit()):
        cluster = SharedCluster(nodes)
        _set_room(cluster, 0, [700])
        choice = policy.choose(cluster, first)
        assert choice is not None
        cluster.place(first, choice)
        fits = 0
        while (c := policy.choose(cluster, later)) is not None:
            cluster.place(later, c)
            fits += 1
        placed[policy.name] = (choice[0], fits)
    # Best-fit takes the tightest node (a: 400 left, lost to 700 shares); FGD the free GPU of b,
    # leaving 700 on each: both later shares fit.
    assert placed == {"fgd-exact": (1, 2), "fgd": (1, 2), "bestfit": (0, 1)}


def test_fgd_chooses_the_gpu_on_a_node_too() -> None:
    cluster = SharedCluster([_node("a", 2)])
    _set_room(cluster, 0, [1000, 700])
    share = _task(300)
    assert FGD(_mix((_task(700), 1))).choose(cluster, share) == (0, (0,))  # 700 and 700 stay usable
    assert BestFit().choose(cluster, share) == (0, (1,))  # tightest GPU: 1000 and 400
    # With whole-GPU tasks in the workload, FGD fills the used GPU instead.
    assert FGD(_mix((_task(1000), 1))).choose(cluster, share) == (0, (1,))


def test_the_typical_mix_is_the_artifacts() -> None:
    """The FGD artifact's typical pods: every task counts (CPU-only too), memory is not part of a
    shape, and the most popular shapes covering 95% of the tasks are kept, renormalised."""
    tasks = (
        [_task(500, mem=1024)] * 10
        + [_task(500, mem=4096)] * 8  # the same shape once memory is left out: 18 tasks
        + [GpuTask("cpu", 2000, 1, 0, 0)] * 6
        + [_task(250)]  # 1 of 25 tasks: past the 95% the first two shapes cover (24 of 25)
    )
    ours = TaskMix.of(tasks)
    assert len(ours) == 3 and sorted(ours.mem.tolist()) == [1024, 1024, 4096]
    typical = ours.typical()
    assert list(zip(typical.num_gpu.tolist(), typical.milli.tolist(), typical.p.tolist(), strict=True)) == [
        (1, 500, 0.75),
        (0, 0, 0.25),
    ]
    assert typical.mem.tolist() == [0, 0] and typical.cpu.tolist() == [1000, 2000]
    assert sorted(ours.typical(1.0).p.tolist()) == pytest.approx([1 / 25, 6 / 25, 18 / 25])
    hand_made = TaskMix(ours.cpu, ours.mem, ours.num_gpu, ours.milli, ours.spec, ours.p)
    with pytest.raises(ConfigError, match="typical mix needs"):
        hand_made.typical()


def test_a_cpu_only_shape_loses_every_free_gpu_and_memory_does_not_count_in_the_typical_mix() -> None:
    typical = TaskMix.of([_task(500, mem=8192)] * 3 + [GpuTask("cpu", 1000, 1, 0, 0)]).typical()
    cluster = SharedCluster([_node("a", 2, mem=4096)])
    # The share cannot run for memory, but the artifact's measure has no memory: no fragment for it;
    # the CPU-only quarter finds 2000 free thousandths it cannot use, though it fits.
    assert _frag(cluster, typical) == [500.0]
    assert _frag(cluster, TaskMix.of([_task(500, mem=8192)])) == [2000.0]  # ours counts memory


def test_fgd_node_score_is_the_artifacts_integer_sigmoid() -> None:
    rises = np.array([0.0, 0.001, 30.0, -30.0, -60.0, 1000.0, 5000.0, 1e9, -1e9])
    assert fgd_node_score(rises).tolist() == [50, 49, 49, 50, 51, 26, 0, 0, 100]


def test_k8s_fgd_ties_rises_within_a_score_step_and_breaks_ties_by_a_random_node_order() -> None:
    # 97% light shares, 2% CPU-heavy shares, 1% whole GPUs. A 100 share with 2000 CPU: on a (41,000
    # CPU) both the heavy and the whole shapes lose the GPU (rise 27), on b only the whole one (9).
    mix = _mix((_task(500), 97), (_task(500, cpu=40_000), 2), (_task(1000), 1))
    nodes = [_node("a", 1, cpu=41_000), _node("b", 1)]
    task = _task(100, cpu=2000)
    assert FGD(mix).choose(SharedCluster(nodes), task) == (1, (0,))  # the least rise
    # Both rises score 49: the node comes first in the random order, which differs between seeds.
    picks = {FGD(mix, score="k8s", seed=seed).choose(SharedCluster(nodes), task) for seed in range(12)}
    assert picks == {(0, (0,)), (1, (0,))}
    # Alike nodes: exact FGD takes the tightest (the first of equals), k8s the random order's first.
    alike = [_node(f"n{i}", 2) for i in range(6)]
    assert FGD(mix).choose(SharedCluster(alike), task) == (0, (0,))
    assert (
        len({FGD(mix, score="k8s", seed=seed).choose(SharedCluster(alike), task) for seed in range(12)}) > 1
    )


def test_k8s_fgd_gives_a_share_the_first_gpu_with_the_best_score() -> None:
    # GPU 0 free, GPU 1 with 600 left; 98% 500 shares, 1% 600 shares, 1% whole GPUs. A 100 share on
    # GPU 0 raises F by 9 (no whole GPU left), on GPU 1 by 4: both score 49.
    mix = _mix((_task(500), 98), (_task(600), 1), (_task(1000), 1))
    cluster = SharedCluster([_node("a", 2)])
    _set_room(cluster, 0, [1000, 600])
    assert FGD(mix).choose(cluster, _task(100)) == (0, (1,))
    assert FGD(mix, score="k8s").choose(cluster, _task(100)) == (0, (0,))


def test_make_packing_fgd_is_the_artifacts_form_and_fgd_exact_the_least_rise() -> None:
    mix = TaskMix.of([_task(500, mem=4096)] * 9 + [GpuTask("cpu", 1000, 1, 0, 0)])
    fgd, exact = make_packing("fgd", mix, seed=3), make_packing("fgd-exact", mix)
    assert isinstance(fgd, FGD) and isinstance(exact, FGD)
    assert (fgd.name, fgd.k8s, fgd.seed) == ("fgd", True, 3)
    assert fgd.mix is not None and fgd.mix.num_gpu.tolist() == [0, 1] and fgd.mix.mem.tolist() == [0, 0]
    assert (exact.name, exact.k8s, exact.mix) == ("fgd-exact", False, mix)
    with pytest.raises(ConfigError, match="exact or k8s"):
        FGD(mix, score="closest")


def test_fgd_rise_matches_a_recomputation_from_scratch() -> None:
    """FGD keeps rises per shape between tasks: its choice must be as good as recomputing them all."""
    rng = np.random.default_rng(3)
    nodes = [
        _node(f"n{i}", int(rng.choice([1, 2, 4, 8])), model=str(rng.choice(["A", "B"]))) for i in range(12)
    ]
    shapes = [
        _task(1000),
        _task(500),
        _task(250, cpu=8000),
        _task(1000, num_gpu=2),
        GpuTask("cpu", 16000, 1, 0, 0),
    ]
    shapes.append(_task(700, gpu_spec=("B",)))
    mix = TaskMix.of(shapes)
    cluster = SharedCluster(nodes)
    policy, frag = FGD(mix), Fragmentation(mix, cluster)
    for _ in range(120):
        task = shapes[int(rng.integers(len(shapes)))]
        choice = policy.choose(cluster, task)
        if choice is None:
            assert not cluster.feasible(task).any()
            continue
        best = np.inf
        for node in np.flatnonzero(cluster.feasible(task)):
            options = [(g,) for g in range(nodes[node].gpus) if cluster.left[node, g] >= task.gpu_milli]
            if task.num_gpu != 1:
                options = [tuple(np.flatnonzero(cluster.left[node] >= task.gpu_milli)[: task.num_gpu])]
            for gpus in options:
                before = frag.of_nodes(cluster, np.array([node]))[0]
                cluster.place(task, (int(node), tuple(int(g) for g in gpus)))
                best = min(best, frag.of_nodes(cluster, np.array([node]))[0] - before)
                cluster.release(task, (int(node), tuple(int(g) for g in gpus)))
        before = frag.of_nodes(cluster, np.array([choice[0]]))[0]
        cluster.place(task, choice)
        assert frag.of_nodes(cluster, np.array([choice[0]]))[0] - before == pytest.approx(best, abs=1e-9)


def test_baselines_and_the_cluster_bookkeeping() -> None:
    cluster = SharedCluster([_node("a", 2, model="T4"), _node("b", 4, model="V100")])
    assert cluster.capacity_milli == 6000 and cluster.unallocated == 1.0
    assert FirstFit().choose(cluster, _task(1000, num_gpu=2)) == (0, (0, 1))
    assert FirstFit().choose(cluster, _task(1000, num_gpu=3)) == (1, (0, 1, 2))
    assert FirstFit().choose(cluster, _task(1000, num_gpu=5)) is None
    assert FirstFit().choose(cluster, _task(500, gpu_spec=("V100",))) == (1, (0,))
    picks = {RandomFit(seed).choose(cluster, _task(500))[0] for seed in range(20)}  # type: ignore[index]
    assert picks == {0, 1}
    cluster.place(_task(600), (1, (2,)))
    assert cluster.unallocated == pytest.approx(1 - 600 / 6000)
    with pytest.raises(CapacityError, match="no room"):
        cluster.place(_task(600), (1, (2,)))
    with pytest.raises(CapacityError, match="not in"):
        cluster.place(_task(100, gpu_spec=("V100",)), (0, (0,)))
    cluster.release(_task(600), (1, (2,)))
    assert cluster.unallocated == 1.0 and cluster.free.tolist() == [2000, 4000]
    assert make_packing("dotprod").choose(cluster, _task(1000)) is not None
    with pytest.raises(ConfigError, match="choose one of"):
        make_packing("worstfit")
    with pytest.raises(ConfigError, match="needs the workload's task mix"):
        make_packing("fgd")


def test_inflate_tops_up_or_thins_to_the_ratio() -> None:
    tasks = [_task(500), _task(1000, num_gpu=2), GpuTask("cpu", 1000, 1, 0, 0)]
    up = inflate(tasks, capacity_gpus=20, ratio=1.3, seed=1)
    asked = sum(t.gpu for t in up)
    assert asked <= 26 and asked > 26 - 2  # stops before passing 130% of 20 GPUs
    assert all(up.count(t) >= 1 for t in tasks)  # the trace's own tasks are all there
    down = inflate(tasks * 10, capacity_gpus=2, ratio=1.0, seed=1)
    assert sum(t.gpu for t in down) <= 2.0


def test_fill_records_unallocated_capacity_as_arrivals_pass_each_point() -> None:
    cluster = SharedCluster([_node("a", 2)])
    arrivals = [_task(700), _task(700), _task(700), _task(300)]
    r = fill(cluster, arrivals, FirstFit(), points=[0.5, 1.0, 1.2], mix=_mix((_task(700), 1)))
    # Arrived (of 2 GPUs): 35%, 70%, 105%, 120%. Each point is recorded with the arrivals up to it
    # placed: 50% after the first, 100% after two (a 700 share on each GPU); the third 700 finds no
    # GPU with room, the 300 fits.
    assert r.points == [0.5, 1.0, 1.2]
    assert r.unallocated == pytest.approx([0.65, 0.3, 0.15])
    assert (r.placed, r.failed, r.failed_gpu) == (3, 1, pytest.approx(0.7))
    assert r.at(1.0) == pytest.approx(0.3)
    assert r.fragmentation == pytest.approx([0.15, 0.3, 0.15])  # the room of GPUs with < 700 left


def test_replay_starts_waiting_tasks_in_order_when_room_frees() -> None:
    cluster = SharedCluster([_node("a", 1)])
    tasks = [
        _task(600, creation=0.0, duration=10.0),
        _task(600, creation=1.0, duration=10.0),  # waits for the first: starts at 10
        _task(300, creation=2.0, duration=5.0),  # fits beside the first at once
        _task(1000, num_gpu=2, creation=3.0, duration=1.0),  # never fits: rejected
    ]
    r = replay(cluster, tasks, BestFit())
    assert (r.tasks, r.rejected, r.waited) == (3, 1, 1)
    assert r.avg_jct_s == pytest.approx((10 + 19 + 5) / 3)
    assert r.avg_wait_s == pytest.approx(9 / 3) and r.makespan_s == 20.0
    faster = replay(SharedCluster([_node("a", 1)]), tasks, BestFit(), time_scale=0.5)
    assert faster.avg_jct_s == pytest.approx((10 + 19.5 + 5) / 3)  # second arrives at 0.5
    with pytest.raises(ConfigError, match="creation and deletion times"):
        replay(cluster, [_task(500)], BestFit())


def test_online_fgd_learns_the_mix_from_arrivals() -> None:
    cluster = SharedCluster([_node("a", 1), _node("b", 1)])
    _set_room(cluster, 0, [700])
    policy = make_packing("fgd-online")
    assert isinstance(policy, FGD) and policy.name == "fgd-online" and policy.mix is None
    cpu_only = GpuTask("cpu", 1000, 1, 0, 0)
    assert policy.choose(cluster, cpu_only) == BestFit().choose(cluster, cpu_only)  # nothing learned yet
    assert policy.mix is None
    # The first GPU task is the whole mix: a 700 share fills a's 700 exactly (no rise; on b, 300
    # would be left that no 700 share can use).
    assert policy.choose(cluster, _task(700)) == (0, (0,))
    assert policy.mix is not None and policy.mix.milli.tolist() == [700]
    # Now 300 and 700 shares, half each: a 300 on a would leave 400, lost to 700s; on b, 700 stays.
    assert policy.choose(cluster, _task(300)) == (1, (0,))
    # Re-estimated when the GPU tasks seen double: 1, 2, 4, ...
    assert sorted(policy.mix.milli.tolist()) == [300, 700] and policy.mix.p.tolist() == [0.5, 0.5]
    for _ in range(2):
        policy.choose(cluster, _task(1000))
    assert sorted(policy.mix.p.tolist()) == [0.25, 0.25, 0.5]


def test_live_packing_estimates_its_mix_from_the_jobs_known_as_their_number_doubles_or_halves() -> None:
    from collections import Counter

    from gpuyard.scheduler.packing import LivePacking

    half, quarter, whole = (0, 0, 1, 500, ()), (0, 0, 1, 250, ()), (0, 0, 1, 1000, ())
    live = LivePacking("fgd-online")
    assert isinstance(live.policy, BestFit)  # no GPU job known yet
    live.observe(Counter({half: 1}))
    first = live.policy
    assert isinstance(first, FGD) and first.name == "fgd-exact" and first.mix is not None
    live.observe(Counter({quarter: 1}))  # as many jobs: the estimate stays
    assert live.policy is first
    live.observe(Counter({half: 1, quarter: 1}))  # doubled: estimated again, on both shapes
    assert live.policy is not first and len(live.policy.mix) == 2  # type: ignore[attr-defined]
    live.observe(Counter({half: 2, quarter: 1, whole: 0}))  # 3 of 2: not yet
    second = live.policy
    live.observe(Counter({(0, 0, 0, 0, ()): 5}))  # only CPU jobs left: best-fit again
    assert second is not live.policy and isinstance(live.policy, BestFit)
    assert isinstance(LivePacking("bestfit").policy, BestFit)
    with pytest.raises(ConfigError, match="packing 'tightest'"):
        LivePacking("tightest")
