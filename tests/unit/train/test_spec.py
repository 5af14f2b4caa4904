"""Spec validation names the field; entrypoints say which and why; plans map onto the mesh layout."""

from __future__ import annotations

import json
import re
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


def test_cli_dry_run_builds_model_and_data_as_the_ranks_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuyard.cli.main import main

    model = {"entrypoint": "gpuyard.train.examples:mlp", "kwargs": {"hiden": 3}}
    with pytest.raises(SystemExit) as code:
        main(["train", str(_write(tmp_path, {**GOOD, "model": model})), "--dry-run"])
    assert code.value.code == 2
    err = capsys.readouterr().err
    assert "model.kwargs: got an unexpected keyword argument 'hiden'" in err and "Traceback" not in err
    data = {"train": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"rows": 9}}}
    with pytest.raises(SystemExit) as code:
        main(["train", str(_write(tmp_path, {**GOOD, "data": data})), "--dry-run"])
    assert code.value.code == 2 and "data.train.kwargs: got an unexpected keyword argument 'rows'" in (
        capsys.readouterr().err
    )


def test_cli_dry_run_prints_the_torchrun_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpuyard.cli.main import main

    with pytest.raises(SystemExit) as code:
        main(["train", str(_write(tmp_path, GOOD)), "--nproc", "2", "--dry-run", "--json"])
    assert code.value.code in (0, None)
    cmd = json.loads(capsys.readouterr().out)["command"]
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "gpuyard.train.worker" in cmd


def _checkpoint_of_world(tmp_path: Path, world: int) -> Path:
    """A spec with a per-rank batch whose run folder holds a checkpoint as `world` ranks of data
    parallel write it, as far as the launcher reads it: trained here in one process, then its marker
    and rank 0's data position say `world` (with rank0.pt's digest updated, so it stays intact).
    tests/multiproc/train/test_elastic_resume.py writes a real one over two nodes of 2 and 1 ranks."""
    import hashlib

    import torch

    from gpuyard.train.checkpoint import MARKER, latest_checkpoint
    from gpuyard.train.trainer import Trainer

    doc = {
        **GOOD,
        "run_dir": str(tmp_path / "run"),
        "data": {**GOOD["data"], "batch_size": 8},
        "max_steps": 1,
        "checkpoint": {"every_steps": 1},
        "tracking": "jsonl",
    }
    path = _write(tmp_path, doc)
    trainer = Trainer(load_spec(path))
    try:
        trainer.fit()
    finally:
        trainer.close()
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None
    state = torch.load(ckpt / "rank0.pt", weights_only=True)
    assert state["data"]["dp_size"] == 1
    state["data"]["dp_size"] = world
    torch.save(state, ckpt / "rank0.pt")
    marker = json.loads((ckpt / MARKER).read_text())
    blob = (ckpt / "rank0.pt").read_bytes()
    marker["files"]["rank0.pt"] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (ckpt / MARKER).write_text(json.dumps({**marker, "world_size": world, "layout": [1, world, 1]}))
    return path


def test_an_unequal_gang_resumes_at_its_whole_world_size(tmp_path: Path) -> None:
    """Nodes of 2 and 1 ranks resume a checkpoint of world size 3 with --world-size 3; each node's
    own --nproc x --nnodes (4 and 2) would refuse it, and a real change of world is still refused."""
    spec = _checkpoint_of_world(tmp_path, 3)
    rdzv = "127.0.0.1:29400"
    for nproc in (2, 1):
        prepare(LaunchConfig(spec, nproc=nproc, nnodes=2, rdzv=rdzv, world_size=3))
        with pytest.raises(ConfigError, match=rf"this run has {2 * nproc} .*--world-size") as err:
            prepare(LaunchConfig(spec, nproc=nproc, nnodes=2, rdzv=rdzv))
        assert f"= --nproc {nproc} x --nnodes 2" in str(err.value)
    with pytest.raises(ConfigError, match=r"size 3 \(batch 8 per rank\), this run has 4 .*from --world-size"):
        prepare(LaunchConfig(spec, nproc=2, nnodes=2, rdzv=rdzv, world_size=4))  # 2 + 2: a real change
    # Nothing changes for one node: --world-size is its --nproc.
    prepare(LaunchConfig(spec, nproc=3, world_size=3))
    # torchrun's shortcut for identical nodes would number these ranks wrongly: refused.
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "1")
        with pytest.raises(ConfigError, match=r"TORCH_ELASTIC_WORKER_IDENTICAL=1 .* world is 3 over 2 nodes"):
            prepare(LaunchConfig(spec, nproc=1, nnodes=2, rdzv=rdzv, world_size=3))


def test_the_parallel_layout_is_checked_against_the_whole_world(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _write(tmp_path, {**GOOD, "parallel": {"tp": 2, "data_parallel": "fsdp"}})
    prepare(LaunchConfig(spec, nproc=4, nnodes=2, rdzv="h:1", world_size=6))  # 4 + 2: tp groups in nodes
    assert "spans two nodes" not in caplog.text
    with pytest.raises(ConfigError, match=r"divide the world size 5 \(world size 5 from --world-size"):
        prepare(LaunchConfig(spec, nproc=4, nnodes=2, rdzv="h:1", world_size=5))  # 4 + 1
    # 3 + 1: the world divides, but a tp group holds rank 2 (here) and rank 3 (the other node).
    prepare(LaunchConfig(spec, nproc=3, nnodes=2, rdzv="h:1", world_size=4))
    assert (
        "parallel.tp=2 does not divide --nproc 3 on this node: a tensor-parallel group spans" in caplog.text
    )
    with pytest.raises(ConfigError, match=r"divide the world size 3 \(world size 3 = --nproc 1 x --nnodes 3"):
        prepare(LaunchConfig(spec, nproc=1, nnodes=3, rdzv="h:1"))


@pytest.mark.parametrize(
    ("nproc", "nnodes", "world", "message"),
    [
        (2, 1, 3, r"one node \(--nnodes 1\) runs --nproc 2 ranks; give --world-size 2"),
        (2, 2, 2, "--world-size 2 is too small: --nproc 2 ranks on this node .* at least 3"),
        (8, 3, 9, "--world-size 9 is too small: .* other 2 node\\(s\\) of --nnodes 3 make at least 10"),
        (1, 2, 0, "--world-size 0 is too small"),
    ],
)
def test_an_impossible_world_size_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nproc: int, nnodes: int, world: int, message: str
) -> None:
    from gpuyard.cli.main import main

    args = ["train", str(_write(tmp_path, GOOD)), "--nproc", str(nproc), "--nnodes", str(nnodes)]
    args += ["--rdzv", "h:1", "--world-size", str(world), "--dry-run"]
    with pytest.raises(SystemExit) as code:
        main(args)
    assert code.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
