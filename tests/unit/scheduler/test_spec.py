"""Job specs: validation names the field; states only move along allowed transitions."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.scheduler.executors.base import job_argv, job_env
from gpuyard.scheduler.spec import TRANSITIONS, JobState, load_spec, parse_spec, parse_team_weights

pytestmark = pytest.mark.unit


def test_valid_spec_with_defaults(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: train-1\ncommand: python train.py --lr 0.1\nresources: {gpus: 2}\nteam: research\n")
    spec = load_spec(f)
    assert spec.command == ["python", "train.py", "--lr", "0.1"]
    assert spec.resources.gpus == 2 and spec.resources.cpus == 1 and spec.max_restarts == 0


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"name": "x", "command": "true", "resources": {"gpus": -1}}, "resources.gpus"),
        ({"name": "x", "command": "true", "resources": {"gpu": 1}}, "resources.gpu"),
        ({"name": "bad name!", "command": "true"}, "name"),
        ({"name": "x"}, "exactly one of command or train"),
        ({"name": "x", "command": "true", "train": "t.yaml"}, "exactly one of command or train"),
        ({"name": "x", "command": "true", "priority": 5000}, "priority"),
    ],
)
def test_invalid_specs_name_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_spec(doc)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        load_spec(tmp_path / "nope.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(f)


def test_training_spec_becomes_gpuyard_train_with_nproc() -> None:
    spec = parse_spec({"name": "t", "train": "spec.yaml", "resources": {"gpus": 4}, "checkpoint_dir": "/ck"})
    argv = job_argv(spec)
    assert argv[-6:] == ["train", "spec.yaml", "--nproc", "4", "--run-dir", "/ck"]
    multi = job_argv(spec, nproc=8, nnodes=2, rdzv="10.0.0.1:29500", world_size=12)
    assert multi[-10:-2] == [
        "--nproc",
        "8",
        "--nnodes",
        "2",
        "--rdzv",
        "10.0.0.1:29500",
        "--world-size",
        "12",
    ]
    env = job_env(7, spec, 2, (0, 3))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,3" and env["GPUYARD_CHECKPOINT_DIR"] == "/ck"
    assert job_env(7, parse_spec({"name": "c", "command": "true"}), 1, ())["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gang_placed_unequally_passes_its_whole_world_to_every_node() -> None:
    from gpuyard.scheduler.executors.base import NodeSlots, gang_world_size

    spec = parse_spec({"name": "t", "train": "spec.yaml", "resources": {"gpus": 12}})
    nodes = [NodeSlots("a", tuple(range(8))), NodeSlots("b", (0, 1, 2, 3))]
    assert gang_world_size(spec, nodes) == 12  # 8 + 4, not 2 nodes x 8 (or x 4)
    for node in nodes:
        argv = job_argv(spec, nproc=len(node.gpus), nnodes=2, rdzv="a:29500", world_size=12)
        assert argv[argv.index("--nproc") + 1] == str(len(node.gpus))
        assert argv[argv.index("--world-size") + 1] == "12"
    # CPU-only nodes run spec.nproc each.
    cpu = parse_spec({"name": "c", "train": "spec.yaml", "nproc": 3})
    assert gang_world_size(cpu, [NodeSlots("a", ()), NodeSlots("b", ())]) == 6
    # A multi-node training argv without its world, or with one its nodes cannot make, is a bug.
    with pytest.raises(ValueError, match="world size None"):
        job_argv(spec, nproc=8, nnodes=2, rdzv="a:29500")
    with pytest.raises(ValueError, match="world size 8 for 2 nodes"):
        job_argv(spec, nproc=8, nnodes=2, rdzv="a:29500", world_size=8)
    # One node, or a command job: no --world-size.
    assert "--world-size" not in job_argv(spec, nproc=8)
    assert job_argv(parse_spec({"name": "c", "command": "true"}), nnodes=2, rdzv="a:1") == ["true"]


def test_the_ray_executor_gives_each_node_its_own_nproc_and_the_whole_world(tmp_path: Path) -> None:
    from gpuyard.scheduler.executors.base import NodeSlots
    from gpuyard.scheduler.executors.ray import RayExecutor

    ex = object.__new__(RayExecutor)  # no cluster: plan() only reads these
    ex.jobs_dir, ex.limits, ex._ips = tmp_path, None, {"a": "10.0.0.1"}
    spec = parse_spec({"name": "t", "train": "spec.yaml", "resources": {"gpus": 12}})
    plan = ex.plan(5, spec, [NodeSlots("a", tuple(range(8))), NodeSlots("b", (0, 1, 2, 3))], 1)
    argvs = plan.extra["rank_argv"]
    assert [a[a.index("--nproc") + 1] for a in argvs] == ["8", "4"]
    assert {a[a.index("--world-size") + 1] for a in argvs} == {"12"}
    assert {a[a.index("--rdzv") + 1] for a in argvs} == {"10.0.0.1:29505"}


def test_transitions_cover_the_life_of_a_job() -> None:
    assert JobState.SCHEDULED in TRANSITIONS[JobState.QUEUED]
    assert JobState.QUEUED in TRANSITIONS[JobState.PREEMPTED]
    assert all(not TRANSITIONS[s] for s in JobState if s.terminal)


def test_team_weights() -> None:
    assert parse_team_weights(["a=2", "b"]) == {"a": 2.0, "b": 1.0}
    with pytest.raises(ConfigError, match="weight"):
        parse_team_weights(["a=-1"])
