"""Spec validation names the field; entrypoints say which and why; plans map onto the mesh layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpuyard.errors import ConfigError
from gpuyard.train.launch import LaunchConfig, prepare, torchrun_command
from gpuyard.train.parallel import resolve_layout
from gpuyard.train.spec import ParallelSpec, load_spec, parallel_from_plan

pytestmark = pytest.mark.unit

GOOD = {
    "name": "t",
    "model": {"entrypoint": "gpuyard.train.examples:mlp"},
    "data": {"train": {"entrypoint": "gpuyard.train.examples:classification_data"}},
}


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"optimizer": {"lr": -1}}, "optimizer.lr"),
        ({"epochs": 0}, "epochs"),
        ({"parallel": {"pp_schedule": "zigzag"}}, "parallel.pp_schedule"),
        ({"checkpoint": {"kep": 3}}, "checkpoint.kep"),
        ({"data": {"train": {"entrypoint": "x:y"}, "batch_size": "big"}}, "data.batch_size"),
    ],
)
def test_spec_errors_name_the_field(tmp_path: Path, patch: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_spec(_write(tmp_path, {**GOOD, **patch}))
    assert f"{field}:" in str(err.value) and str(tmp_path) in str(err.value)


def test_missing_model_and_bad_yaml_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: Field required"):
        load_spec(_write(tmp_path, {"data": GOOD["data"]}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(ConfigError, match=r"missing\.yaml: no such file"):
        load_spec(tmp_path / "missing.yaml")


def test_pipeline_batch_must_split_into_microbatches(tmp_path: Path) -> None:
    doc = {**GOOD, "data": {**GOOD["data"], "batch_size": 10}, "parallel": {"pp": 2, "microbatches": 4}}
    with pytest.raises(ConfigError, match=r"parallel\.microbatches=4"):
        load_spec(_write(tmp_path, doc))


def test_prepare_checks_entrypoints_and_layout_before_starting(tmp_path: Path) -> None:
    doc = {**GOOD, "data": {"train": {"entrypoint": "gpuyard.train.examples:no_data"}}}
    with pytest.raises(ConfigError, match=r"data\.train\.entrypoint"):
        prepare(LaunchConfig(_write(tmp_path, doc), nproc=2))
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        prepare(LaunchConfig(_write(tmp_path, {**GOOD, "parallel": {"tp": 2}}), nproc=3))
    with pytest.raises(ConfigError, match="--rdzv"):
        prepare(LaunchConfig(_write(tmp_path, GOOD), nproc=2, nnodes=2))


def test_plan_maps_onto_the_mesh(tmp_path: Path) -> None:
    plan = {"best": {"dp": 2, "tp": 2, "pp": 1, "step_time_s": 0.3}, "cluster": "x"}
    assert parallel_from_plan(plan) == {"dp": 2, "tp": 2, "pp": 1}
    with pytest.raises(ConfigError, match="integer 'dp'"):
        parallel_from_plan({"dp": "two"})
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    cfg = LaunchConfig(
        _write(tmp_path, {**GOOD, "parallel": {"data_parallel": "fsdp"}}), nproc=4, plan_path=plan_path
    )
    spec, overrides = prepare(cfg)
    # The plan's sizes merge into the spec's parallel section; its other settings stay.
    assert (spec.parallel.dp, spec.parallel.tp, spec.parallel.data_parallel) == (2, 2, "fsdp")
    cmd = torchrun_command(cfg, spec, overrides)
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert json.loads(cmd[cmd.index("--parallel") + 1]) == {"dp": 2, "tp": 2, "pp": 1}


def test_multi_node_command_uses_rendezvous(tmp_path: Path) -> None:
    cfg = LaunchConfig(_write(tmp_path, GOOD), nproc=8, nnodes=2, rdzv="10.0.0.1:29400", max_restarts=5)
    spec, overrides = prepare(cfg)
    cmd = torchrun_command(cfg, spec, overrides)
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--max-restarts=5"} <= set(
        cmd
    )
    assert "--standalone" not in cmd


@pytest.mark.parametrize(
    ("parallel", "world", "expected"),
    [
        ({}, 4, (1, 4, 1)),
        ({"tp": 2, "data_parallel": "fsdp"}, 4, (1, 2, 2)),
        ({"pp": 2}, 2, (2, 1, 1)),
        ({"pp": 2}, 4, (2, 2, 1)),
        ({"pp": 2, "dp": 2, "data_parallel": "fsdp"}, 4, (2, 2, 1)),
        ({"pp": 2, "tp": 2}, 4, (2, 1, 2)),
        ({"pp": 2, "tp": 2, "data_parallel": "fsdp"}, 8, (2, 2, 2)),
        ({"dp": 1, "tp": 2}, 2, (1, 1, 2)),
    ],
)
def test_layout_fills_dp(parallel: dict, world: int, expected: tuple[int, int, int]) -> None:
    layout = resolve_layout(ParallelSpec(**parallel), world)
    assert (layout.pp, layout.dp, layout.tp) == expected


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        ({"dp": 3}, 2, "= 3 ranks, but the job has 2"),
        ({"pp": 2, "tp": 2, "dp": 2}, 8, "use 'fsdp' to combine dp=2 with tp=2 (with or without pp)"),
        ({"tp": 2, "dp": 2}, 4, "data_parallel: use 'fsdp'"),
    ],
)
def test_layout_errors_name_the_field(parallel: dict, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match="parallel") as err:
        resolve_layout(ParallelSpec(**parallel), world)
    assert message in str(err.value)


def test_cli_reports_bad_spec_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuyard.cli.main import main

    spec = _write(tmp_path, {**GOOD, "model": {"entrypoint": "gpuyard.train.examples:missing_model"}})
    with pytest.raises(SystemExit) as code:
        main(["train", str(spec), "--dry-run"])
    assert code.value.code == 2
    err = capsys.readouterr().err
    assert "model.entrypoint" in err and "missing_model" in err and "Traceback" not in err


def test_cli_dry_run_prints_the_torchrun_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as code:
        main(["train", str(_write(tmp_path, GOOD)), "--nproc", "2", "--dry-run", "--json"])
    assert code.value.code in (0, None)
    cmd = json.loads(capsys.readouterr().out)["command"]
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "gpuyard.train.worker" in cmd
