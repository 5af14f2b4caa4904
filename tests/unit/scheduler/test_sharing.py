"""GPU shares and MIG slices: spec validation, placement on a fake inventory, launch environment."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import ConfigError
from gpuyard.hardware.fake import FakeNvml, load_description, set_mig, write_host_tree
from gpuyard.hardware.probe import probe_node
from gpuyard.hardware.sysfs import HostRoots
from gpuyard.scheduler.executors.base import MpsConfig, NodeSlots, job_env
from gpuyard.scheduler.nodes import node_from_inventory
from gpuyard.scheduler.placement import (
    ClusterState,
    GpuShare,
    NodeSpec,
    place,
    record_part,
    share_never_fits,
    share_of,
    why_waiting,
)
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.unit

H100 = Path(__file__).parents[1] / "hardware" / "fixtures" / "h100_hgx.json"


def _spec(resources: dict[str, Any]) -> Any:
    return parse_spec({"name": "s", "command": "true", "resources": resources})


# -- spec ----------------------------------------------------------------------------------------


def test_a_fraction_becomes_a_share_and_whole_gpus_stay_an_int() -> None:
    res = _spec({"gpus": 0.25}).resources
    assert (res.gpus, res.gpu_fraction, res.shared) == (0, 0.25, True)
    assert share_of(res.model_dump()) == GpuShare(fraction=0.25)
    whole = _spec({"gpus": 2.0}).resources
    assert whole.gpus == 2 and isinstance(whole.gpus, int) and not whole.shared
    assert share_of(whole.model_dump()) is None
    mem = _spec({"gpu_memory_gb": 20}).resources
    assert share_of(mem.model_dump()) == GpuShare(memory_gb=20.0)
    mig = _spec({"mig": "1g.10gb", "slices": 2}).resources
    assert share_of(mig.model_dump()) == GpuShare(mig="1g.10gb", slices=2)
    # The stored spec validates again to the same thing (the server re-reads it at launch).
    again = parse_spec(_spec({"gpus": 0.5}).model_dump(mode="json"))
    assert again.resources.gpu_fraction == 0.5 and again.resources.gpus == 0


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"gpus": 1.5}, r"resources\.gpus: .*1\.5 GPUs: above 1 only whole GPUs"),
        ({"gpus": -0.5}, r"resources\.gpus"),
        ({"gpu_fraction": 1.0}, r"resources\.gpu_fraction"),
        ({"gpus": 2, "gpu_memory_gb": 10}, r"resources\.gpu_memory_gb: .*cannot go with gpus: 2"),
        ({"mig": "1g.11gb"}, r"resources\.mig: .*'1g\.11gb' is not an A100/H100 MIG profile; known: 1g\.5gb"),
        ({"mig": "1g.10gb", "gpus": 1}, r"resources\.mig: .*MIG slices go alone"),
        ({"slices": 2}, r"resources\.slices: .*give mig"),
        ({"gpu_memory_gb": 0}, r"resources\.gpu_memory_gb"),
    ],
)
def test_bad_share_requests_name_the_field_in_one_line(resources: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _spec(resources)
    assert "\n" not in str(err.value)


# -- placement -----------------------------------------------------------------------------------


def _node(gpus: int = 2, memory_gb: float = 80.0, **kw: Any) -> NodeSpec:
    return NodeSpec("n0", gpus, "H100", "n0", "leaf0", cpus=4, gpu_memory_gb=memory_gb, **kw)


def test_shares_pack_onto_one_gpu_up_to_one_and_leave_the_other_whole() -> None:
    state = ClusterState([_node()])
    a = place(state, 0, share=GpuShare(fraction=0.5))
    assert a is not None and a.gpus == 0 and len(a.parts) == 1
    state.take(a)
    assert state.free_gpus == 1  # the shared GPU is no longer free for whole-GPU jobs
    b = place(state, 0, share=GpuShare(fraction=0.5))
    assert b is not None and b.parts[0].gpu == a.parts[0].gpu  # packed onto the same GPU
    state.take(b)
    assert state.gpu_use()[(0, a.parts[0].gpu)][0] == pytest.approx(1.0)
    c = place(state, 0, share=GpuShare(fraction=0.25))
    assert c is not None and c.parts[0].gpu != a.parts[0].gpu  # the full GPU takes no more: a fresh one
    state.take(c)
    assert state.free_gpus == 0
    assert place(state, 1) is None  # no whole GPU left
    state.release(a)
    state.release(b)
    assert state.free_gpus == 1 and place(state, 1) is not None  # the first GPU is whole again


def test_memory_counts_too_and_a_share_by_memory_holds_its_part_of_the_gpu() -> None:
    state = ClusterState([_node(gpus=2, memory_gb=80.0)])
    a = place(state, 0, share=GpuShare(memory_gb=60))
    assert a is not None and a.parts[0].fraction == pytest.approx(0.75) and a.parts[0].memory_gb == 60
    state.take(a)
    # 0.1 of compute fits beside 0.75, but 30 GB does not fit beside 60 of 80 GB: another GPU.
    b = place(state, 0, share=GpuShare(fraction=0.1, memory_gb=30))
    assert b is not None and b.parts[0].gpu != a.parts[0].gpu
    small = place(state, 0, share=GpuShare(fraction=0.1, memory_gb=10))
    assert small is not None and small.parts[0].gpu == a.parts[0].gpu


def test_mig_slices_go_one_job_each_and_their_gpus_are_never_whole() -> None:
    from gpuyard.scheduler.placement import MigSlice

    slices = (
        MigSlice(1, "3g.40gb", "MIG-a"),
        MigSlice(1, "3g.40gb", "MIG-b"),
        MigSlice(1, "1g.10gb", "MIG-c"),
    )
    state = ClusterState([_node(gpus=2, mig_mode=(1,), mig=slices)])
    assert state.total_gpus == 1  # GPU 1 is in MIG mode
    first = place(state, 0, share=GpuShare(mig="3g.40gb"))
    assert first is not None and first.parts[0].mig_uuid == "MIG-a" and first.parts[0].gpu == 1
    state.take(first)
    second = place(state, 0, share=GpuShare(mig="3g.40gb"))
    assert second is not None and second.parts[0].mig_uuid == "MIG-b"
    state.take(second)
    assert place(state, 0, share=GpuShare(mig="3g.40gb")) is None
    assert "0 of 2 such slices free" in why_waiting(state, 0, share=GpuShare(mig="3g.40gb"))
    assert place(state, 0, share=GpuShare(mig="3g.40gb", slices=2)) is None
    assert place(state, 2) is None and place(state, 1) is not None  # only GPU 0 is whole
    state.release(first)
    assert place(state, 0, share=GpuShare(mig="3g.40gb")) is not None


def test_records_rebuild_the_same_state() -> None:
    from gpuyard.scheduler.placement import MigSlice

    node = _node(gpus=3, mig_mode=(2,), mig=(MigSlice(2, "1g.10gb", "MIG-x"),))
    state = ClusterState([node])
    share = place(state, 0, share=GpuShare(fraction=0.5))
    assert share is not None
    mig = place(state, 0, share=GpuShare(mig="1g.10gb"))
    assert mig is not None
    records = [
        record_part("n0", (0,), 0, [share.parts[0]]),
        record_part("n0", (2,), 0, list(mig.parts)),
        record_part("n0", (1,), 0, []),
    ]
    assert records[0]["share"] == {"fraction": 0.5, "memory_gb": 40.0}
    assert records[1]["mig"] == [{"gpu": 2, "profile": "1g.10gb", "uuid": "MIG-x"}]
    state.reset()
    for r in records:
        state.hold_record(0, r)
    assert state.free_gpus == 0 and state.mig_used == {"MIG-x"}
    assert state.gpu_use() == {(0, 0): (0.5, 40.0)}
    again = place(state, 0, share=GpuShare(fraction=0.5))
    assert again is not None and again.parts[0].gpu == 0  # the recorded GPU, not a fresh one


def test_recorded_shares_rounded_to_their_record_still_fill_a_gpu() -> None:
    # 79.6 GiB (an H100 80GB as NVML reports it): each half holds 39.8237 GiB, recorded as 39.824, so
    # two recorded halves sum past the GPU's memory by the rounding; the second half still fits.
    node = _node(gpus=1, memory_gb=85520809984 / 2**30)
    state = ClusterState([node])
    half = place(state, 0, share=GpuShare(fraction=0.5))
    assert half is not None
    state.reset()
    state.hold_record(0, record_part("n0", (0,), 0, [half.parts[0]]))
    second = place(state, 0, share=GpuShare(fraction=0.5))
    assert second is not None and second.parts[0].gpu == 0
    state.hold_record(0, record_part("n0", (0,), 0, [second.parts[0]]))
    assert place(state, 0, share=GpuShare(fraction=0.01)) is None  # now it is full
    thirds = ClusterState([node])
    for _ in range(3):
        p = place(thirds, 0, share=GpuShare(fraction=1 / 3))
        assert p is not None and p.parts[0].gpu in (0, -1)  # the recorded GPU 0, or a fresh one at first
        thirds.hold_record(0, record_part("n0", (0,), 0, [replace(p.parts[0], gpu=0)]))
    assert thirds.free_gpus == 0 and len(thirds.gpu_use()) == 1


def test_what_can_never_fit_is_said_in_one_line() -> None:
    from gpuyard.scheduler.placement import MigSlice

    state = ClusterState([_node(gpus=1, mig_mode=(0,), mig=(MigSlice(0, "3g.40gb", "MIG-a"),))])
    assert "no GPU here can be shared" in str(share_never_fits(state, GpuShare(fraction=0.5)))
    assert share_never_fits(state, GpuShare(mig="3g.40gb")) is None
    assert "no GPU here has a 1g.10gb slice; MIG slices here: 3g.40gb x1" in str(
        share_never_fits(state, GpuShare(mig="1g.10gb"))
    )
    assert "2 3g.40gb slices asked, a node here has at most 1" in str(
        share_never_fits(state, GpuShare(mig="3g.40gb", slices=2))
    )
    plain = ClusterState([_node(gpus=1, memory_gb=80.0)])
    assert "100 GB asked, the largest GPU here has 80.0 GB" in str(
        share_never_fits(plain, GpuShare(memory_gb=100))
    )
    unknown = ClusterState([_node(gpus=1, memory_gb=0.0)])
    assert "do not report their memory" in str(share_never_fits(unknown, GpuShare(memory_gb=10)))
    assert share_never_fits(unknown, GpuShare(fraction=0.3)) is None


def test_fifo_starts_two_half_shares_on_one_gpu_and_a_whole_job_waits_with_why() -> None:
    state = ClusterState([_node(gpus=1)])
    policy = make_policy("fifo")
    queue = JobQueue(policy.key)
    for i in (1, 2):
        queue.add(QueuedJob(id=i, gpus=0, submit_time=i, share=GpuShare(fraction=0.5)))
    queue.add(QueuedJob(id=3, gpus=1, submit_time=3))
    decision = policy.decide(state, queue, [], now=10.0)
    assert [j.id for j, _ in decision.starts] == [1, 2]
    gpus = {p.parts[0].gpu for _, p in decision.starts}
    assert len(gpus) == 1  # the same (fresh) GPU
    work = state.copy()
    for _, p in decision.starts:
        work.take(p)
    assert why_waiting(work, 1) == "waiting for 1 GPU: 0 whole free (1 shared)"


def test_backfill_keeps_a_share_off_the_gpu_a_reserved_job_needs() -> None:
    from gpuyard.scheduler.placement import Placement
    from gpuyard.scheduler.queue import RunningJob

    state = ClusterState([_node(gpus=2)])
    held = Placement(((0, 1),), "running")
    state.take(held)
    running = [RunningJob(9, 1, "default", 0, started_at=0.0, expected_end=100.0, placement=held)]
    policy = make_policy("priority")
    queue = JobQueue(policy.key)
    queue.add(QueuedJob(id=1, gpus=2, priority=5, submit_time=1))  # blocked: reserved for t=100
    queue.add(QueuedJob(id=2, gpus=0, submit_time=2, estimate=1000.0, share=GpuShare(fraction=0.5)))
    queue.add(QueuedJob(id=3, gpus=0, submit_time=3, estimate=10.0, share=GpuShare(fraction=0.5)))
    decision = policy.decide(state, queue, running, now=0.0)
    assert decision.reservation == (1, 100.0)
    # The long share would still hold the free GPU at t=100; the short one ends before: it backfills.
    assert [j.id for j, _ in decision.starts] == [3]


# -- the inventory and the launch environment ----------------------------------------------------


def _mig_node(tmp_path: Path) -> NodeSpec:
    desc = copy.deepcopy(load_description(H100))
    desc["nvml"]["gpus"] = desc["nvml"]["gpus"][:3]
    set_mig(desc, 2, ["3g.40gb", "2g.20gb", "1g.10gb"])
    inv = probe_node(
        FakeNvml(desc), roots=HostRoots.under(write_host_tree(desc, tmp_path)), frameworks=False, hostname="h"
    )
    return node_from_inventory(inv.to_dict())


def test_a_node_from_a_fake_mig_inventory(tmp_path: Path) -> None:
    node = _mig_node(tmp_path)
    assert node.mig_mode == (2,) and node.whole_gpus == [0, 1]
    assert [s.profile for s in node.mig] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    assert all(s.uuid.startswith("MIG-") and s.gpu == 2 for s in node.mig)
    assert 79 < node.gpu_memory_gb < 80  # 85.5e9 bytes in GiB
    assert node.gpu_uuids[0].startswith("GPU-")
    state = ClusterState([node])
    p = place(state, 0, share=GpuShare(mig="2g.20gb"))
    assert p is not None and p.parts[0].mig_uuid == node.mig[1].uuid


def test_job_env_of_mig_mps_and_time_sliced_shares() -> None:
    spec = _spec({"gpus": 0.5})
    mig = NodeSlots("n", (2,), mig=("MIG-a", "MIG-b"))
    env = job_env(1, spec, 1, mig.gpus, mig)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-a,MIG-b"
    share = NodeSlots("n", (1,), share=0.25, memory_gb=20.0, uuid="GPU-1")
    sliced = job_env(1, spec, 1, share.gpus, share)
    assert sliced["CUDA_VISIBLE_DEVICES"] == "1" and sliced["GPUYARD_GPU_SHARING"] == "time-slicing"
    assert not any(k.startswith("CUDA_MPS") for k in sliced)
    assert (sliced["GPUYARD_GPU_SHARE"], sliced["GPUYARD_GPU_MEMORY_GB"]) == ("0.25", "20")
    mps = job_env(1, spec, 1, share.gpus, share, MpsConfig("/tmp/mps-pipe", "/tmp/mps-log"))
    assert mps["CUDA_VISIBLE_DEVICES"] == "GPU-1"  # MPS remaps indices: clients name GPUs by UUID
    assert mps["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert mps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480MB"
    assert (mps["CUDA_MPS_PIPE_DIRECTORY"], mps["CUDA_MPS_LOG_DIRECTORY"]) == (
        "/tmp/mps-pipe",
        "/tmp/mps-log",
    )
    whole = job_env(1, _spec({"gpus": 2}), 1, (0, 1), NodeSlots("n", (0, 1)))
    assert whole["CUDA_VISIBLE_DEVICES"] == "0,1" and "GPUYARD_GPU_SHARE" not in whole
    assert MpsConfig.from_env({}) is None
    assert MpsConfig.from_env({"GPUYARD_MPS_PIPE_DIRECTORY": "/p"}) == MpsConfig("/p")


def test_records_past_what_is_free_are_held_without_failing_the_tick() -> None:
    from gpuyard.scheduler.placement import MigSlice

    # GPU 1 failed its health check while a share ran on it; a record names GPU 7 of a 2-GPU node and
    # a MIG slice the inventory no longer has. The tick holds what it can and places around it.
    node = _node(gpus=3, excluded=frozenset({1}), mig_mode=(2,), mig=(MigSlice(2, "1g.10gb", "MIG-x"),))
    state = ClusterState([node])
    assert state.total_gpus == 1 and state.shares.whole_gpus.tolist() == [1]
    state.hold_record(0, {"node": "n0", "gpus": [1], "cpus": 0, "share": {"fraction": 0.5, "memory_gb": 40}})
    state.hold_record(0, {"node": "n0", "gpus": [7], "cpus": 0, "share": {"fraction": 0.5, "memory_gb": 40}})
    state.hold_record(
        0,
        {"node": "n0", "gpus": [2], "cpus": 0, "mig": [{"gpu": 2, "profile": "1g.10gb", "uuid": "MIG-gone"}]},
    )
    assert state.mig_used == set() and state.free_gpus == 1
    share = place(state, 0, share=GpuShare(fraction=0.5))
    assert share is not None and share.parts[0].gpu == 0  # never the failed GPU 1
    assert place(state, 0, share=GpuShare(mig="1g.10gb")) is not None


def test_a_copy_changes_its_own_share_model_only() -> None:
    state = ClusterState([_node(gpus=2)])
    work = state.copy()
    p = place(work, 0, share=GpuShare(fraction=0.75))
    assert p is not None
    work.take(p)
    assert work.gpu_use() == {(0, 0): (0.75, 60.0)} and state.gpu_use() == {}
    again = work.copy()
    again.release(p)
    assert again.gpu_use() == {} and work.gpu_use() == {(0, 0): (0.75, 60.0)}
    assert again.free_gpus == 2 and work.free_gpus == 1


def test_an_unknown_packing_is_refused_before_the_service_touches_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuyard.scheduler.setup import build_service

    monkeypatch.setenv("GPUYARD_HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError) as err:
        build_service(packing="worstfit")
    assert str(err.value).startswith("packing 'worstfit': choose one of fgd, fgd-exact, fgd-bf, fgd-online")
    assert not (tmp_path / "home").exists()  # no store was opened
