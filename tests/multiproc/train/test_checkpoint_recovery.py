"""`gpuyard train` with damaged checkpoints and a full disk, and a spec whose run is already done.

One base run (2 ranks, a model from the spec's own folder: ``model: shapes:make``) is copied for
each damage: a checkpoint whose weights changed and one with a truncated shard are set aside and the
newest intact one is loaded, in one attempt; a save that fills the disk stops without torchrun
restarts, leaves no temporary folder and closes the run in the store.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from gpuyard import exitcodes
from gpuyard.cli.main import app
from gpuyard.tracking.files import read_metrics
from gpuyard.tracking.training import tracked_run_id
from gpuyard.train.checkpoint import list_checkpoints

from .conftest import env_for, finish

pytestmark = pytest.mark.multiproc

SHAPES = """
from gpuyard.train.examples import mlp


def make():
    return mlp(dropout=0.0)
"""


def _spec(folder: Path, **fields: Any) -> Path:
    doc: dict[str, Any] = {
        "name": "recovery",
        "run_dir": str(folder / "run"),
        "seed": 5,
        "model": "shapes:make",  # shapes.py next to the spec; nothing on PYTHONPATH says where
        "data": {
            "train": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 256}},
            "val": {"entrypoint": "gpuyard.train.examples:classification_data", "kwargs": {"n": 64}},
            "batch_size": 16,
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
        "epochs": 10,
        "max_steps": 12,
        "checkpoint": {"every_steps": 4, "keep": 3, "at_epoch_end": False},
        "straggler": {"enabled": False},
        "max_restarts": 2,
        "tracking": "jsonl",
    }
    doc.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shapes.py").write_text(SHAPES)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _train(spec: Path, folder: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`gpuyard train SPEC --nproc 2` from another folder; returns (exit code, stderr)."""
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "train", str(spec), "--nproc", "2", *args]
    proc = subprocess.Popen(
        cmd, env=env or env_for(folder), cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    code, _, err = finish(proc)
    return code, err


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    events = read_metrics(run_dir)
    last = max(i for i, e in enumerate(events) if e["event"] == "launch")
    return [e for e in events[last:] if e["event"] == "attempt"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: checkpoints at steps 4, 8 and 12."""
    folder = tmp_path_factory.mktemp("base")
    spec = _spec(folder)
    code, err = _train(spec, folder)
    assert code == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("completed at step 12") and "val_accuracy" in last, last
    assert [p.name for p in list_checkpoints(folder / "run" / "checkpoints")] == [
        "step-000000004",
        "step-000000008",
        "step-000000012",
    ]
    return folder


def _copy(base: Path, to: Path, **fields: Any) -> Path:
    shutil.copytree(base / "run", to / "run")
    return _spec(to, **fields)


def test_a_finished_spec_resubmitted_says_already_complete(base: Path) -> None:
    before = len(read_metrics(base / "run"))
    code, err = _train(base / "spec.yaml", base)
    assert code == 0, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("already complete at step 12; nothing to train")
    assert len(read_metrics(base / "run")) == before  # no launch, no torchrun, no new run


WEIGHT = "model.0.weight"


def _change_sixteen_floats(ckpt: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata()
    [where] = [s for i, s in meta.storage_data.items() if i.fqn == WEIGHT]
    blob = bytearray((ckpt / where.relative_path).read_bytes())
    at = where.offset + where.length - 64 - 8  # inside the tensor's bytes, before its record ends
    blob[at : at + 64] = struct.pack("<16f", *[1e4] * 16)
    (ckpt / where.relative_path).write_bytes(bytes(blob))


def test_changed_weights_and_a_truncated_shard_are_set_aside_and_the_intact_one_loaded(
    base: Path, tmp_path: Path
) -> None:
    spec = _copy(base, tmp_path, max_steps=14)
    root = tmp_path / "run" / "checkpoints"
    _change_sixteen_floats(root / "step-000000012")
    shard = sorted((root / "step-000000008").glob("*.distcp"))[-1]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    code, err = _train(spec, tmp_path)
    assert code == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("completed at step 14"), last
    assert "resumed from step 4 after setting aside step 12 (" in last and "step 8 (" in last, last
    assert "does not match its sha256" in last and "(truncated or replaced)" in last, last
    # Kept, renamed; never loaded: one attempt (no torchrun restarts), resumed from step 4.
    assert (root / "corrupt-step-000000012").is_dir() and (root / "corrupt-step-000000008").is_dir()
    assert [a["step"] for a in _attempts(tmp_path / "run")] == [4]
    assert "Traceback" not in err


def test_a_save_that_fills_the_disk_stops_without_restarts_and_closes_the_run(
    tmp_path: Path, gpuyard_home: Path
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        spec = _spec(
            tmp_path,
            run_dir=str(disk / "run"),
            tracking="db",
            callbacks=["hooks:fill_disk"],
        )
        code, err = _train(spec, tmp_path, env=env_for(tmp_path, fill="6"))
        assert code == exitcodes.UNRECOVERABLE, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"failed at step 8: disk full at {disk / 'run' / 'checkpoints'}"), last
        assert "exit 74" in last, last
        assert not list((disk / "run" / "checkpoints").glob(".tmp-*"))  # the failed save's folder went
        assert [p.name for p in list_checkpoints(disk / "run" / "checkpoints")] == ["step-000000004"]
        assert "Traceback" not in err
        run_id = tracked_run_id(disk / "run")
        assert run_id is not None
        out = CliRunner().invoke(app, ["runs", "show", run_id[:8], "--json"])
        assert out.exit_code == 0, out.output
        shown = json.loads(out.stdout)
        assert shown["status"] == "failed" and "disk full" in json.dumps(shown), out.stdout[:2000]
        assert len(_attempts_or_none(disk / "run")) <= 1
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _attempts_or_none(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return _attempts(run_dir)
    except ValueError:
        return []
