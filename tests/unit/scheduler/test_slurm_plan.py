"""What the Slurm executor asks of Slurm for a gang: sbatch options and the batch script's srun, for
equal splits (one job) and unequal ones (a heterogeneous job, one component per GPU count)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuyard.errors import ConfigError, StoreError
from gpuyard.scheduler.executors.base import LaunchPlan, NodeSlots
from gpuyard.scheduler.executors.slurm import SlurmConfig, SlurmExecutor
from gpuyard.scheduler.executors.slurm_batch import SlurmBatch
from gpuyard.scheduler.executors.slurm_script import RDZV_PLACEHOLDER
from gpuyard.scheduler.executors.slurm_states import exit_from_state
from gpuyard.scheduler.spec import parse_spec

pytestmark = pytest.mark.unit

JOB_WIDE = ("--job-name=", "--output=", "--open-mode=", "--chdir=", "--export=", "--no-requeue", "--uid=")


def _executor(tmp_path: Path, **config: Any) -> SlurmExecutor:
    ex = object.__new__(SlurmExecutor)  # no cluster: plan() and script() only read these
    ex.jobs_dir, ex.prefix, ex.isolation = tmp_path / "jobs", "gpuyard-t-", None
    ex.config = SlurmConfig(**config)
    ex._addr = {f"n{i}": f"10.0.0.{i}" for i in range(1, 9)}
    return ex


def _slots(*gpus: int) -> list[NodeSlots]:
    return [NodeSlots(f"n{i}", tuple(range(g))) for i, g in enumerate(gpus, start=1)]


def _components(opts: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for opt in opts:
        if opt == ":":
            out.append([])
        else:
            out[-1].append(opt)
    return out


def _value(opts: list[str], key: str) -> str | None:
    found = [o.split("=", 1)[1] for o in opts if o.startswith(f"--{key}=")]
    assert len(found) <= 1, f"--{key} given {len(found)} times in {opts}"
    return found[0] if found else None


def _srun_parts(ex: SlurmExecutor, plan: LaunchPlan) -> list[list[str]]:
    """The batch script's srun command line, split into its ":"-separated parts."""
    last = ex.script(plan).strip().splitlines()[-1]
    argv = shlex.split(last)
    assert argv[:2] == ["exec", "srun"], last
    return _components(argv[2:])


def _asked(opts: list[str]) -> list[tuple[list[str], int]]:
    """(nodes, GPUs per node) of each component of the sbatch options."""
    out = []
    for comp in _components(opts):
        nodes = (_value(comp, "nodelist") or "").split(",")
        assert _value(comp, "nodes") == str(len(nodes)), comp
        out.append((nodes, int(_value(comp, "gpus-per-node") or 0)))
    return out


def _train(tmp_path: Path, gpus: int, **more: Any) -> Any:
    spec = tmp_path / "train.yaml"
    spec.write_text("name: t\n")
    return parse_spec({"name": "t", "train": str(spec), "resources": {"gpus": gpus}, **more})


def test_an_equal_split_is_one_job_with_gpus_per_node(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    plan = ex.plan(7, _train(tmp_path, 16), _slots(8, 8), 1)
    opts = plan.extra["sbatch"]
    assert ":" not in opts and "het_argv" not in plan.extra
    assert _asked(opts) == [(["n1", "n2"], 8)]
    (srun,) = _srun_parts(ex, plan)
    assert not any(x.startswith("--het-group") for x in srun)
    assert srun[srun.index("--nproc") + 1] == "8" and srun[srun.index("--nnodes") + 1] == "2"
    assert srun[srun.index("--world-size") + 1] == "16"


@pytest.mark.parametrize(
    ("gpus", "want"),
    [
        ((8, 4), [(["n1"], 8), (["n2"], 4)]),  # a 12-GPU gang on a full node and half of another
        ((5, 3, 3), [(["n1"], 5), (["n2", "n3"], 3)]),  # fragmented nodes: one component per count
        ((3, 5, 3), [(["n1", "n3"], 3), (["n2"], 5)]),  # the first node's count comes first
        ((4, 4, 2, 1), [(["n1", "n2"], 4), (["n3"], 2), (["n4"], 1)]),
    ],
)
def test_an_unequal_split_is_a_heterogeneous_job_asking_exactly_the_placed_gpus(
    tmp_path: Path, gpus: tuple[int, ...], want: list[tuple[list[str], int]]
) -> None:
    ex = _executor(tmp_path, partition="gpu", account="lab")
    spec = _train(tmp_path, sum(gpus), time_limit_min=30, resources={"gpus": sum(gpus), "memory_gb": 2})
    plan = ex.plan(7, spec, _slots(*gpus), 1)
    opts = plan.extra["sbatch"]
    asked = _asked(opts)
    assert asked == want
    assert sum(len(nodes) * per for nodes, per in asked) == sum(gpus)  # not len(nodes) x the first's
    comps = _components(opts)
    for i, comp in enumerate(comps):
        # Job-wide settings once, in the first component; each component its own limits and tasks.
        assert any(o.startswith(JOB_WIDE) for o in comp) == (i == 0), comp
        assert _value(comp, "ntasks-per-node") == "1" and _value(comp, "time") == "30"
        assert _value(comp, "partition") == "gpu" and _value(comp, "account") == "lab"
        assert _value(comp, "mem") == "2048M"
    # One srun over all components, each running its nodes' own --nproc against one rendezvous.
    parts = _srun_parts(ex, plan)
    assert len(parts) == len(want)
    rdzv = set()
    for group, (part, (_, per)) in enumerate(zip(parts, want, strict=True)):
        assert part[0] == f"--het-group={group}" and "--kill-on-bad-exit=1" in part
        assert part[part.index("--nproc") + 1] == str(per)
        assert part[part.index("--nnodes") + 1] == str(len(gpus))
        # The job's ranks over all nodes: each node's launcher checks resume and layout against it.
        assert part[part.index("--world-size") + 1] == str(sum(gpus))
        rdzv.add(part[part.index("--rdzv") + 1])
    assert rdzv == {RDZV_PLACEHOLDER}  # the batch host's address and a port free there, in each task
    assert plan.env["MASTER_ADDR"] == "10.0.0.1" and plan.env["NNODES"] == str(len(gpus))
    assert plan.extra["het_groups"] == [{"nodes": n, "gpus_per_node": g} for n, g in want]


def test_a_command_spread_unequally_runs_the_same_command_once_per_node(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    cmd = ["bash", "-c", "echo $SLURM_GPUS_ON_NODE"]
    plan = ex.plan(3, parse_spec({"name": "c", "command": cmd, "resources": {"gpus": 12}}), _slots(8, 4), 1)
    assert _asked(plan.extra["sbatch"]) == [(["n1"], 8), (["n2"], 4)]
    for part in _srun_parts(ex, plan):
        assert part[part.index("gpuyard") + 1 :] == cmd and "--ntasks-per-node=1" in part


def test_a_single_node_job_is_unchanged(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    plan = ex.plan(3, _train(tmp_path, 4), _slots(4), 1)
    assert _asked(plan.extra["sbatch"]) == [(["n1"], 4)]
    assert ex.script(plan).strip().splitlines()[-1].startswith("exec ") and "srun" not in ex.script(plan)


def test_a_cluster_without_heterogeneous_steps_refuses_an_unequal_gang_before_sbatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = _executor(tmp_path)
    ex.het_steps = False  # SchedulerParameters=disable_hetjob_steps: srun would fail after allocation

    def no_call(argv: list[str], **_: object) -> str:
        raise AssertionError(f"{argv[0]} called")

    monkeypatch.setattr(ex, "_call", no_call)
    plan = ex.plan(3, _train(tmp_path, 12), _slots(8, 4), 1)
    with pytest.raises(ConfigError, match="disable_hetjob_steps") as info:
        ex.launch(plan)
    assert "n1: 8, n2: 4" in str(info.value) and "\n" not in str(info.value)
    equal = ex.plan(4, _train(tmp_path, 8), _slots(4, 4), 1)
    monkeypatch.setattr(ex, "_call", lambda argv, **_: "77\n")
    assert ex.launch(equal)["slurm_id"] == "77"  # equal splits need no heterogeneous step


def test_a_heterogeneous_job_is_polled_ended_and_found_by_its_first_component(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """squeue lists a heterogeneous job once per component (``41+0``, ``41+1``) and scontrol shows one
    line each: the job is known, polled, ended, recovered and adopted by its first component's id."""
    ex = object.__new__(SlurmExecutor)
    ex.prefix, ex._states, ex._states_at, ex._seen = "gpuyard-t-", {}, float("-inf"), {}
    ex._held = {}
    answers: dict[str, str] = {}

    def call(argv: list[str], check: bool = True, **_: object) -> str:
        return answers[argv[0]]

    monkeypatch.setattr(ex, "_call", call)
    answers["squeue"] = (
        "41+0|RUNNING|None|n1|now|N/A|gpuyard-t-5-1\n41+1|RUNNING|None|n2|now|N/A|gpuyard-t-5-1\n"
    )
    assert ex.poll({"slurm_id": "41"}) is None  # running: not mistaken for a job Slurm no longer lists
    answers["squeue"] = (
        "41+0|PENDING|Resources|(null)|N/A|N/A|gpuyard-t-5-1\n41+1|PENDING|Priority|x|N/A|N/A|g\n"
    )
    assert ex.describe_pending({"slurm_id": "41"}) == "Resources"
    answers["squeue"] = ""
    ex._states_at = float("-inf")
    answers["scontrol"] = (
        "JobId=41 HetJobId=41 HetJobOffset=0 JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 "
        "EndTime=2026-11-27T09:35:47\n"
        "JobId=42 HetJobId=41 HetJobOffset=1 JobState=CANCELLED Reason=None ExitCode=0:15 "
        "EndTime=2026-11-27T09:35:48\n"
    )
    ended = ex.poll({"slurm_id": "41"})
    assert ended == exit_from_state("FAILED", "3:0", "2026-11-27T09:35:47")
    answers["squeue"] = "41+0\n41+1\n"
    assert ex.recover(5, {"slurm_name": "gpuyard-t-5-1"})["slurm_id"] == "41"  # type: ignore[index]
    answers["squeue"] = "gpuyard-t-5-1|41+0\ngpuyard-t-5-1|41+1\nother|9\n"
    assert ex.adopt() == {"gpuyard-t-5-1": "41"}


def test_the_rendezvous_port_is_picked_on_the_batch_host_when_the_job_starts(tmp_path: Path) -> None:
    """Not job id + 29500: two jobs on the same first node whose ids differ by 1000 would collide. The
    script picks a free port on the node it runs on (Slurm's batch host, whichever of the nodes that is),
    takes that node's NodeAddr as MASTER_ADDR, and each task puts both in its command."""
    ex = _executor(tmp_path)
    plan = ex.plan(7, _train(tmp_path, 12), _slots(8, 4), 1)
    script = ex.script(plan)
    head = "\n".join(line for line in script.splitlines() if not line.startswith("exec "))
    for batch_host, addr in (("n2", "10.0.0.2"), ("n1", "10.0.0.1")):
        got = subprocess.run(
            ["bash", "-c", f"{head}\necho $MASTER_ADDR $MASTER_PORT"],
            capture_output=True, text=True, env={"PATH": os.environ["PATH"], "SLURMD_NODENAME": batch_host},
        )  # fmt: skip
        master, port = got.stdout.split()
        assert master == addr and 1024 <= int(port) <= 65535 and int(port) != 29507, got
    srun = shlex.split(script.strip().splitlines()[-1])
    inner = srun[srun.index("-c") + 1]
    env = {"PATH": os.environ["PATH"], "MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "40123"}
    out = subprocess.run(
        ["bash", "-c", inner, "gpuyard", "echo", "--rdzv", RDZV_PLACEHOLDER, "a b"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "--rdzv 10.9.8.7:40123 a b"


@pytest.mark.parametrize("gpus", [(4,), (8, 8), (8, 4), (5, 3, 3)])
def test_the_batch_request_reads_back_as_it_was_planned(tmp_path: Path, gpus: tuple[int, ...]) -> None:
    ex = _executor(tmp_path)
    plan = ex.plan(7, _train(tmp_path, sum(gpus)), _slots(*gpus), 2)
    batch = SlurmBatch.of(plan.extra)
    assert batch.to_extra() == plan.extra  # the handle's keys, unchanged, and nothing lost
    assert list(batch.sbatch) == plan.extra["sbatch"] and batch.script.endswith("attempt-2.sbatch")
    assert len(batch.het_groups) == (len(set(gpus)) if len(set(gpus)) > 1 else 0)
    assert [g.gpus_per_node for g in batch.het_groups] == (
        [] if len(set(gpus)) == 1 else list(dict.fromkeys(gpus))
    )
    assert batch.addrs == {f"n{i}": f"10.0.0.{i}" for i in range(1, len(gpus) + 1)}


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ({"sbatch": "--uid=0"}, "sbatch: expected a list"),
        ({"sbatch": ["--mem=1G", 7]}, "sbatch: expected a string"),
        ({"script": None}, "script: expected a string"),
        ({"isolated": "yes"}, "isolated: expected true or false"),
        ({"isolated": True}, "isolated, but no uid"),
        ({"isolated": True, "uid": -1, "gid": 5, "user_name": "u"}, "uid: expected a non-negative integer"),
        ({"isolated": True, "uid": True, "gid": 5, "user_name": "u"}, "uid: expected a non-negative integer"),
        ({"het_groups": [{"nodes": ["n1"], "gpus_per_node": 8}]}, "1 heterogeneous groups but 0 commands"),
        ({"addrs": ["n1"]}, "addrs: expected an object"),
    ],
)
def test_a_damaged_batch_request_is_refused_in_one_line(
    tmp_path: Path, damage: dict[str, Any], named: str
) -> None:
    # A handle read back from the database never becomes an sbatch option or a user to run as unchecked.
    ex = _executor(tmp_path)
    extra = {**ex.plan(7, _train(tmp_path, 4), _slots(4), 1).extra, **damage}
    with pytest.raises(StoreError, match=r"^Slurm batch request: ") as err:
        SlurmBatch.of(extra)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_launch_refuses_a_damaged_request_before_writing_or_submitting(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    plan = ex.plan(7, _train(tmp_path, 4), _slots(4), 1)
    plan.extra["sbatch"] = "--uid=0"
    with pytest.raises(StoreError, match="sbatch: expected a list"):
        ex.launch(plan)
    assert not Path(plan.extra["script"]).exists()
