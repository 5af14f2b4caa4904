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
    multi = job_argv(spec, nproc=8, nnodes=2, rdzv="10.0.0.1:29500")
    assert multi[-8:-2] == ["--nproc", "8", "--nnodes", "2", "--rdzv", "10.0.0.1:29500"]
    env = job_env(7, spec, 2, (0, 3))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,3" and env["GPUYARD_CHECKPOINT_DIR"] == "/ck"
    assert job_env(7, parse_spec({"name": "c", "command": "true"}), 1, ())["CUDA_VISIBLE_DEVICES"] == ""


def test_transitions_cover_the_life_of_a_job() -> None:
    assert JobState.SCHEDULED in TRANSITIONS[JobState.QUEUED]
    assert JobState.QUEUED in TRANSITIONS[JobState.PREEMPTED]
    assert all(not TRANSITIONS[s] for s in JobState if s.terminal)


def test_team_weights() -> None:
    assert parse_team_weights(["a=2", "b"]) == {"a": 2.0, "b": 1.0}
    with pytest.raises(ConfigError, match="weight"):
        parse_team_weights(["a=-1"])
