"""MIG in the GPU-sharing simulator: layouts where the hardware allows them, MIG tasks only on free
slices of their profile, never on whole or shared GPUs (and the reverse), slices released at a task's
end, the metrics, and `gpuyard sim --trace` with a `mig` column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.hardware.mig import arrange, placements, profiles_of
from gpuyard.scheduler.fragmentation import TaskMix
from gpuyard.scheduler.gpushares import SharedCluster
from gpuyard.scheduler.openb import (
    GpuNode,
    GpuTask,
    load_openb_nodes,
    load_openb_tasks,
    parse_mig_layout,
)
from gpuyard.scheduler.packing import PACKING_POLICIES, make_packing
from gpuyard.scheduler.packing_replay import fill, replay
from gpuyard.scheduler.trace import has_gpu_shares, load_share_trace, load_trace

H100 = "H100-80GB"
# One GPU: 3g.40gb (memory slices 4-7), 2g.20gb (0-1), two 1g.10gb (2 and 3).
MIXED = "3g.40gb+2g.20gb+2x1g.10gb"


def _node(name: str, gpus: int, layout: str = "", cpu: int = 64000) -> GpuNode:
    mig = parse_mig_layout(layout, H100, gpus, name) if layout else ()
    return GpuNode(name, cpu, 10**6, gpus, H100, mig)


def _mig(profile: str, n: int = 1, cpu: int = 0, **kw: float) -> GpuTask:
    return GpuTask(f"{n}x{profile}", cpu, 0, n, 0, mig=profile, **kw)  # type: ignore[arg-type]


def _whole(n: int = 1, milli: int = 1000, **kw: float) -> GpuTask:
    return GpuTask(f"{n}x{milli}", 0, 0, n, milli, **kw)  # type: ignore[arg-type]


def _policies(tasks: list[GpuTask]) -> list[object]:
    mix = TaskMix.of(tasks) if any(t.num_gpu and not t.mig for t in tasks) else None
    out = []
    for name in PACKING_POLICIES:
        if mix is None and name in ("fgd", "fgd-exact", "fgd-bf"):
            continue
        out.append(make_packing(name, mix, seed=3))
    return out


def test_layouts_take_the_starts_the_mig_user_guide_allows() -> None:
    by_name = {p.name: p for p in profiles_of(H100)}
    assert placements(by_name["1g.10gb"]) == (0, 1, 2, 3, 4, 5, 6)
    assert placements(by_name["1g.20gb"]) == (0, 2, 4, 6)
    assert placements(by_name["2g.20gb"]) == (0, 2, 4)
    assert placements(by_name["3g.40gb"]) == (0, 4)
    assert placements(by_name["4g.40gb"]) == placements(by_name["7g.80gb"]) == (0,)
    # 4g.40gb can only start at 0, so a 3g.40gb beside it goes to 4.
    assert arrange(H100, [("3g.40gb", None), ("4g.40gb", None)]) == [4, 0]
    ((gpu,),) = [parse_mig_layout(MIXED, H100, 1, "t")]
    assert sorted(gpu, key=lambda x: x[0]) == [("1g.10gb", 2), ("1g.10gb", 3), ("2g.20gb", 0), ("3g.40gb", 4)]
    layout = parse_mig_layout("2*7g.80gb|-|*3g.40gb@0+3g.40gb", "NVIDIA A100-SXM4-80GB", 5, "t")
    assert layout == (
        (("7g.80gb", 0),),
        (("7g.80gb", 0),),
        (),
        (("3g.40gb", 0), ("3g.40gb", 4)),
        (("3g.40gb", 0), ("3g.40gb", 4)),
    )
    for text, model, message in (
        ("3g.40gb@0+4g.40gb", H100, "cannot be placed on one H100-80GB"),  # counts fit, starts do not
        ("4g.40gb@4", H100, r"starts at memory slice \{0\}, not 4"),
        ("8x1g.10gb", H100, "at most 7 1g.10gb"),
        ("4g.40gb+4g.40gb", H100, "at most 1 4g.40gb"),
        ("1g.5gb", H100, "'1g.5gb' is not a H100-80GB MIG profile"),
        ("2g.15gb", H100, "'2g.15gb' is not a MIG profile"),
        ("7g.80gb", "T4", "which has no MIG"),
        ("3*7g.80gb", H100, "names 3 GPUs, the node has 2"),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            parse_mig_layout(text, model, 2, "node list n.csv line 2")
        assert "\n" not in str(info.value) and str(info.value).startswith("node list n.csv line 2")


def test_a_mig_task_takes_only_a_free_slice_of_its_profile() -> None:
    tasks = [_mig("3g.40gb"), _mig("3g.40gb"), _mig("1g.10gb", 2), _whole()]
    for policy in _policies(tasks):
        cluster = SharedCluster([_node("n", 2, MIXED)])  # GPU 0 in MIG mode, GPU 1 whole
        choice = policy.choose(cluster, tasks[0])  # type: ignore[attr-defined]
        assert choice is not None
        _, (s,) = choice
        assert (cluster.slice_gpu[s], cluster.mig_profiles[cluster.slice_profile[s]]) == (0, "3g.40gb")
        assert cluster.slice_start[s] == 4
        cluster.place(tasks[0], choice)
        # The only 3g.40gb is held: a second does not start, though 2g, 1g slices and a whole GPU are free.
        assert policy.choose(cluster, tasks[1]) is None  # type: ignore[attr-defined]
        two = policy.choose(cluster, tasks[2])  # type: ignore[attr-defined]
        assert two is not None and len(set(two[1])) == 2
        assert {cluster.mig_profiles[cluster.slice_profile[s]] for s in two[1]} == {"1g.10gb"}


def test_mig_and_whole_gpu_tasks_never_cross() -> None:
    tasks = [_mig("7g.80gb"), _whole(), _whole(1, 500), _whole(2)]
    for policy in _policies(tasks):
        # plain: 2 whole GPUs; mixed: GPU 0 a 7g.80gb instance, GPU 1 whole.
        cluster = SharedCluster([_node("plain", 2), _node("mixed", 2, "7g.80gb")])
        choose = policy.choose  # type: ignore[attr-defined]
        for _ in range(2):  # however often it is asked, the MIG task goes to the MIG slice
            node, slices = choose(cluster, tasks[0])
            assert node == 1 and cluster.slice_gpu[slices[0]] == 0
        cluster.place(tasks[0], (1, slices))
        assert choose(cluster, tasks[0]) is None  # the plain node's whole GPUs are not MIG slices
        assert choose(cluster, tasks[3])[0] == 0  # two whole GPUs: only on the plain node
        placed = []
        for task in (tasks[1], tasks[1], tasks[2]):
            choice = choose(cluster, task)
            assert choice is not None
            cluster.place(task, choice)
            placed.append(choice)
        # Three GPUs can take whole or shared work (plain 0, 1 and mixed 1): never mixed GPU 0.
        assert all(not (node == 1 and gpus == (0,)) for node, gpus in placed)
        assert choose(cluster, tasks[1]) is None
        assert choose(cluster, tasks[2]) == placed[2]  # the shared GPU's other half; nothing else
    cluster = SharedCluster([_node("mixed", 2, "7g.80gb")])
    with pytest.raises(CapacityError, match="GPU 0 of mixed has no room"):
        cluster.place(tasks[1], (0, (0,)))
    with pytest.raises(CapacityError, match=r"no free 3g\.40gb slice"):
        cluster.place(_mig("3g.40gb"), (0, (0,)))  # slice 0 is the 7g.80gb
    assert not cluster.fits_empty(tasks[3]) and cluster.fits_empty(tasks[1])
    assert cluster.never_fits(tasks[3]) == "2 GPUs asked, a node here has at most 1 not in MIG mode"
    assert cluster.never_fits(_mig("1g.10gb")) == (
        "mig 1g.10gb: no GPU here has a 1g.10gb slice; MIG slices here: 7g.80gb x1"
    )
    assert cluster.never_fits(_mig("7g.80gb", 2)) == "mig 7g.80gb: 2 slices asked, a node here has at most 1"


def test_slices_are_released_and_counted_in_the_metrics() -> None:
    cluster = SharedCluster([_node("n", 2, MIXED)])
    assert cluster.unallocated == 1.0 and cluster.mig_unallocated == 1.0 and cluster.free_slices == 4
    task = _mig("3g.40gb")
    choice = make_packing("bestfit").choose(cluster, task)
    assert choice is not None
    cluster.place(task, choice)
    # 3 of 7 compute slices of one of the 2 GPUs are held.
    assert cluster.unallocated == pytest.approx(1 - 3 / 14)
    assert cluster.mig_unallocated == pytest.approx(1 - 3 / 7) and cluster.free_slices == 3
    with pytest.raises(CapacityError, match=r"no free 3g\.40gb"):
        cluster.place(task, choice)  # held already
    cluster.release(task, choice)
    assert cluster.unallocated == 1.0 and cluster.mig_unallocated == 1.0 and cluster.free_slices == 4
    assert cluster.feasible(task).all() and not cluster.slice_busy.any()


def test_replay_starts_waiting_mig_tasks_when_slices_free() -> None:
    # One GPU in MIG mode (MIXED) and one whole. Hand-worked: the second 3g.40gb waits for the first
    # (100 s), the third for the second (200 s); 2x1g.10gb waits for the 1g.10gb to end at 50;
    # the 0.5 share waits for the whole-GPU task (its GPU is the only one it may use).
    tasks = [
        _mig("3g.40gb", creation=0, duration=100),
        _mig("3g.40gb", creation=0, duration=100),
        _mig("1g.10gb", creation=0, duration=50),
        _whole(creation=10, duration=100),
        _whole(1, 500, creation=20, duration=30),
        _mig("3g.40gb", creation=30, duration=100),
        _mig("1g.10gb", 2, creation=40, duration=10),
    ]
    # JCTs 100, 200, 50, 100, 120, 270, 20; waits 0, 100, 0, 0, 90, 170, 10.
    for policy in _policies(tasks):
        cluster = SharedCluster([_node("n", 2, MIXED)])
        r = replay(cluster, tasks, policy)  # type: ignore[arg-type]
        assert r.avg_jct_s == pytest.approx(860 / 7) and r.avg_wait_s == pytest.approx(370 / 7)
        assert r.waited == 4 and r.rejected == 0 and r.makespan_s == 300
        assert r.extra["mig_tasks"] == 5 and r.extra["mig_avg_wait_s"] == pytest.approx(56)
        assert r.extra["mig_avg_jct_s"] == pytest.approx(128)
        assert cluster.free_slices == 4 and cluster.unallocated == 1.0  # all released
    # A MIG task that fits no slice here is rejected, as a whole-GPU task too large.
    r = replay(
        SharedCluster([_node("n", 1, "7g.80gb")]),
        [*tasks[:2], _mig("7g.80gb", duration=5, creation=0)],
        make_packing("firstfit"),
    )
    assert (r.tasks, r.rejected, r.extra["mig_rejected"]) == (1, 2, 2)


def test_fill_counts_mig_slices() -> None:
    nodes = [_node("a", 2, "*7x1g.10gb"), _node("b", 2)]
    tasks = [_mig("1g.10gb"), _whole()]
    arrivals = [tasks[0]] * 14 + [tasks[1]] * 2 + [tasks[0]]
    for policy in _policies(tasks):
        r = fill(SharedCluster(nodes), arrivals, policy, [0.5, 1.0], TaskMix.of(tasks))  # type: ignore[arg-type]
        assert (r.placed, r.failed, r.mig_placed, r.mig_failed) == (16, 1, 14, 1)
        assert r.unallocated == [pytest.approx(0.5), pytest.approx(0.0)]
        assert r.mig_unallocated == [pytest.approx(0.0), pytest.approx(0.0)]
        assert "mig_unallocated" in r.to_dict()
    plain = fill(SharedCluster([_node("b", 2)]), [tasks[1]] * 2, make_packing("bestfit"), [1.0])
    assert "mig_unallocated" not in plain.to_dict()  # results without MIG keep their keys


def test_mig_columns_in_traces_and_node_lists(tmp_path: Path) -> None:
    trace = tmp_path / "jobs.csv"
    trace.write_text("submit_time,duration,num_gpus,mig\n0,10,2,3G.40GB\n5,10,0.5,\n")
    assert has_gpu_shares(trace)
    job, share = load_share_trace(trace)
    assert (job.mig, job.num_gpu, job.gpu, job.shape[-1]) == ("3g.40gb", 2, 6 / 7, "3g.40gb")
    assert (share.mig, share.gpu_milli) == ("", 500)
    with pytest.raises(ConfigError, match="a job asking for MIG slices"):
        load_trace(trace)  # the whole-GPU simulator does not drop the profile
    whole = tmp_path / "whole.csv"
    whole.write_text("submit_time,duration,num_gpus,mig\n0,10,2,\n")
    assert not has_gpu_shares(whole) and load_trace(whole)[0].gpus == 2
    for row, message in (
        ("0,10,1,2g.15gb", "line 2: mig '2g.15gb' is not a MIG profile"),
        ("0,10,0,1g.10gb", "num_gpus counts its slices"),
    ):
        trace.write_text(f"submit_time,duration,num_gpus,mig\n{row}\n")
        with pytest.raises(ConfigError, match=message):
            load_share_trace(trace)
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model,mig\n"
        "a,64000,262144,2,A100-80GB,3g.40gb+4g.40gb|-\n"
        "b,64000,262144,1,T4,\n"
    )
    a, b = load_openb_nodes(nodes)
    assert a.mig == ((("4g.40gb", 0), ("3g.40gb", 4)), ()) and b.mig == ()
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model,mig\nb,64000,262144,1,T4,7g.80gb\n")
    with pytest.raises(ConfigError, match=r"line 2: mig layout .7g\.80gb. on GPU model .T4."):
        load_openb_nodes(nodes)
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,mig\np0,1000,1024,1,0,4g.40gb\np1,0,0,1,500,\n"
    )
    p0, p1 = load_openb_tasks(pods)
    assert (p0.mig, p0.num_gpu, p0.gpu_milli, p1.mig, p1.gpu_milli) == ("4g.40gb", 1, 0, "", 500)


def _sim(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["sim", *args])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def test_gpuyard_sim_replays_a_trace_with_a_mig_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "jobs.csv"
    rows = [
        "0,100,1,3g.40gb",
        "0,100,1,3g.40gb",
        "0,50,1,1g.10gb",
        "10,100,1,",
        "20,30,0.5,",
        "30,100,1,3g.40gb",
        "40,10,2,1g.10gb",
    ]
    trace.write_text("submit_time,duration,num_gpus,mig\n" + "\n".join(rows) + "\n")
    base = ["--trace", str(trace), "--nodes", "1", "--gpus-per-node", "2", "--mig", MIXED]
    code, out, err = _sim([*base, "--json", "--packing", "fgd,bestfit,firstfit"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert "1 GPUs in MIG mode, 4 slices" in doc["trace"]
    for r in doc["results"]:  # the replay worked by hand above
        assert r["avg_jct_s"] == pytest.approx(860 / 7) and r["extra"]["mig_avg_wait_s"] == pytest.approx(56)
    code, out, err = _sim([*base, "--packing", "bestfit"], capsys)
    assert code == 0 and "bestfit: MIG tasks 5 (0 rejected), avg JCT 128 s, avg wait 56.0 s" in out
    code, out, err = _sim([*base, "--packing", "bestfit", "--mode", "fill"], capsys)
    assert code == 0 and "bestfit: MIG tasks" in out and "of the MIG GPUs' compute unallocated" in out
    # A profile no GPU here has: the run goes on, those tasks refused in one line.
    code, out, err = _sim(
        ["--trace", str(trace), "--nodes", "1", "--mig", "7g.80gb|-", "--packing", "bestfit"], capsys
    )
    assert code == 0, err
    assert "refused 3 tasks: mig 3g.40gb: no GPU here has a 3g.40gb slice; MIG slices here: 7g.80gb x1" in out
    bad = tmp_path / "bad.csv"
    bad.write_text("submit_time,duration,num_gpus,mig\n0,10,1,2g.15gb\n")
    for args, message in (
        (
            ["--trace", str(bad), "--nodes", "1", "--mig", "7g.80gb"],
            "line 2: mig '2g.15gb' is not a MIG profile",
        ),
        (["--trace", str(trace), "--nodes", "1"], "no GPU here is in MIG mode: give --mig"),
        (
            [*base[:-1], "4g.40gb@4"],
            "--mig: mig layout '4g.40gb@4': a H100-80GB 4g.40gb starts at memory slice",
        ),
        ([*base, "--mig-model", "T4"], "--mig-model 'T4': choose one of"),
        ([*base, "--policy", "las"], "replayed in arrival order"),
    ):
        code, _, err = _sim(args, capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    only_mig = tmp_path / "only.csv"
    only_mig.write_text("submit_time,duration,num_gpus,mig\n0,10,1,7g.80gb\n0,10,1,7g.80gb\n")
    code, _, err = _sim(["--trace", str(only_mig), "--nodes", "1", "--mig", "7g.80gb"], capsys)
    assert code == 2 and "every GPU task of this trace asks for MIG slices" in err
    code, out, err = _sim(
        ["--trace", str(only_mig), "--nodes", "1", "--mig", "7g.80gb", "--packing", "bestfit", "--json"],
        capsys,
    )
    assert code == 0 and json.loads(out)["results"][0]["avg_jct_s"] == 15.0  # the second waits 10 s


def test_gpuyard_sim_reads_mig_layouts_from_a_node_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "jobs.csv"
    trace.write_text("submit_time,duration,num_gpus,mig\n0,10,1,1g.20gb\n0,10,1,1g.20gb\n0,10,1,\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model,mig\na,64000,262144,1,A100-80GB,4x1g.20gb\nb,64000,262144,1,T4,\n"
    )
    code, out, err = _sim(
        ["--trace", str(trace), "--node-list", str(nodes), "--json", "--packing", "bestfit"], capsys
    )
    assert code == 0, err
    doc = json.loads(out)
    (r,) = doc["results"]
    assert doc["gpus"] == 2 and r["waited"] == 0 and r["avg_jct_s"] == 10.0 and "refused" not in doc
    code, _, err = _sim(["--trace", str(trace), "--node-list", str(nodes), "--mig", "7g.80gb"], capsys)
    assert code == 2 and "mig column" in err


def test_fgd_places_mig_tasks_by_the_rise_their_cpu_causes() -> None:
    # Two MIG nodes alike but for CPU: a CPU-heavy MIG task on the small node would leave too little CPU
    # for the mix's share task there (all its free GPU a fragment); FGD puts it on the big node.
    small, big = _node("small", 2, "7g.80gb", cpu=8000), _node("big", 2, "7g.80gb", cpu=64000)
    share = GpuTask("share", 6000, 0, 1, 500)
    task = _mig("7g.80gb", cpu=4000)
    for name in ("fgd-exact", "fgd"):
        policy = make_packing(name, TaskMix.of([share, task]))
        cluster = SharedCluster([small, big])
        node, slices = policy.choose(cluster, task)  # type: ignore[misc]
        assert node == 1 and cluster.slice_node[slices[0]] == 1
    assert np.array_equal(SharedCluster([small, big]).mig_free_compute, [7, 7])
