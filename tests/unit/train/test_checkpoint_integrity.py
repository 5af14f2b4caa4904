"""Checkpoints verified at load and recovered: hashes of every file, damaged ones set aside, a full
disk ends the run cleanly; snapshots that fail their hash are not restored; what a run reports."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from gpuyard.tracking.files import read_metrics
from gpuyard.train import examples as ex
from gpuyard.train.checkpoint import (
    MARKER,
    CheckpointSaveError,
    file_digest,
    is_disk_full,
    latest_checkpoint,
    list_checkpoints,
    read_marker,
    verify_checkpoint,
)
from gpuyard.train.memory_checkpoint import SNAPSHOT_DIR_ENV

from .conftest import run

pytestmark = pytest.mark.unit


def _events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_metrics(run_dir) if e["event"] == name]


def test_every_file_is_hashed_and_any_change_is_named(spec_factory) -> None:
    spec = spec_factory(max_steps=3, tracking="jsonl")
    run(spec)
    ckpt = latest_checkpoint(spec.resolved_run_dir() / "checkpoints")
    assert ckpt is not None
    files = read_marker(ckpt)["files"]
    assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != MARKER)
    assert {".metadata", "rank0.pt"} <= set(files)  # shards, metadata, loader + RNG state
    for name, want in files.items():
        assert want == {"size": (ckpt / name).stat().st_size, "sha256": file_digest(ckpt / name)}
    assert verify_checkpoint(ckpt) is None

    state = ckpt / "rank0.pt"
    blob = bytearray(state.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit
    state.write_bytes(bytes(blob))
    assert (
        verify_checkpoint(ckpt) == "rank0.pt does not match its sha256 (its content changed after the save)"
    )
    shard = next(ckpt.glob("*.distcp"))
    with open(shard, "r+b") as fh:
        fh.truncate(10)
    # With two ranks each checks half the files: rank 1 finds what rank 0 does not look at.
    problems = {verify_checkpoint(ckpt, r, 2) for r in (0, 1)}
    assert any(p and p.startswith(f"{shard.name} has 10 bytes") for p in problems), problems
    (ckpt / "extra.bin").write_bytes(b"x")
    assert verify_checkpoint(ckpt) == "extra.bin is not one of the files the checkpoint was written with"


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_loaded(spec_factory) -> None:
    spec = spec_factory(max_steps=9, tracking="jsonl", checkpoint={"at_epoch_end": False})
    run(spec)
    root = spec.resolved_run_dir() / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-000000006", "step-000000009"]
    shard = next((root / "step-000000009").glob("*.distcp"))
    blob = bytearray(shard.read_bytes())
    blob[-200:-136] = bytes(64)  # sixteen floats of the last tensors
    shard.write_bytes(bytes(blob))

    _, result = run(spec.model_copy(update={"max_steps": 12}))
    assert result.step == 12
    [aside] = _events(spec.resolved_run_dir(), "checkpoint_set_aside")
    assert aside["step"] == 9 and "does not match its sha256" in aside["reason"]
    assert (root / "corrupt-step-000000009").is_dir()  # kept for a look, never loaded
    assert [e["step"] for e in _events(spec.resolved_run_dir(), "resume")] == [6]


def test_a_completion_marker_that_is_not_json_is_set_aside_like_other_damage(spec_factory) -> None:
    """The launcher's resume check and the workers' load both meet it: no traceback, one line."""
    from gpuyard.train.elastic import check_resume
    from gpuyard.train.parallel import MeshLayout

    spec = spec_factory(max_steps=9, tracking="jsonl", checkpoint={"at_epoch_end": False})
    run(spec)
    root = spec.resolved_run_dir() / "checkpoints"
    (root / "step-000000009" / "COMPLETE.json").write_text('{"step": 9, "files": {')
    check_resume(spec, MeshLayout(1, 1, 1))  # no traceback before the workers start
    _, result = run(spec.model_copy(update={"max_steps": 12}))
    assert result.step == 12
    [aside] = _events(spec.resolved_run_dir(), "checkpoint_set_aside")
    assert aside["step"] == 9 and aside["reason"].startswith("COMPLETE.json unreadable")
    assert [e["step"] for e in _events(spec.resolved_run_dir(), "resume")] == [6]


def test_a_save_on_a_full_disk_removes_its_folder_and_ends_the_run_failed(
    spec_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, Path) and f.parent.name == ".tmp-step-000000006":
            f.write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    spec = spec_factory(tracking="jsonl")  # the database run: test_checkpoint_recovery.py (multiproc)
    with pytest.raises(CheckpointSaveError) as caught:
        run(spec)
    run_dir = spec.resolved_run_dir()
    where = run_dir / "checkpoints"  # the folder on the full disk
    assert caught.value.disk_full and caught.value.reason == f"disk full at {where}"
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-000000003"]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"], status["unrecoverable"]) == ("failed", 6, True)
    [failed] = _events(run_dir, "checkpoint_failed")
    assert failed["disk_full"] and failed["path"] == str(where)

    assert _events(run_dir, "finish")[-1]["status"] == "failed"


def test_metrics_on_a_full_disk_stop_the_run_as_unrecoverable(spec_factory) -> None:
    from gpuyard.tracking.files import JsonlTracker
    from gpuyard.train.checkpoint import DiskFullError

    spec = spec_factory(tracking="jsonl")
    tracker = JsonlTracker(spec.resolved_run_dir())
    real = tracker.log_metrics

    def log_metrics(step: int, metrics: dict[str, float]) -> None:
        if step == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(tracker.path))
        real(step, metrics)

    tracker.log_metrics = log_metrics  # type: ignore[method-assign]
    with pytest.raises(DiskFullError) as caught:
        run(spec, tracker=tracker)
    assert caught.value.reason == f"disk full at {tracker.path}"
    status = json.loads((spec.resolved_run_dir() / "status.json").read_text())
    assert (status["status"], status["unrecoverable"], status["step"]) == ("failed", True, 5)


def test_disk_full_is_found_inside_wrapped_errors(tmp_path: Path) -> None:
    class Wrapped(BaseException):  # as DCP's CheckpointException: failures by rank
        def __init__(self, failures: dict[int, Any]) -> None:
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(Wrapped({1: (full, None)}), tmp_path)
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("writer failed") from exc
    except RuntimeError as exc:
        assert is_disk_full(exc, tmp_path)
    # torch's zip writer says no errno: only a filesystem with (almost) no room left makes it so.
    assert not is_disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path)
    assert not is_disk_full(RuntimeError("Connection closed by peer"), tmp_path)


def test_a_snapshot_whose_data_changed_is_not_restored(
    spec_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    monkeypatch.setenv(SNAPSHOT_DIR_ENV, str(shm))
    spec = spec_factory(
        checkpoint={"every_steps": 0, "at_epoch_end": False, "memory_every": 2}, tracking="jsonl"
    )

    def crash(trainer: Any, event: str) -> None:
        if event == "step" and trainer.step == 9:
            trainer.memory.wait()
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        run(spec, callbacks=[crash])
    newest = max(shm.rglob("*.snap"))
    assert newest.name.startswith("o0-s000000008")
    data = newest.parent / f"o0-slot{newest.name[-6]}.bin"
    with open(data, "r+b") as fh:
        fh.seek(64)
        fh.write(b"\x7f" * 64)  # sixteen floats, changed in memory
    run(spec)
    [resume] = _events(spec.resolved_run_dir(), "resume")
    assert resume["source"] == "memory" and resume["step"] == 6  # the older, intact snapshot
    [dropped] = _events(spec.resolved_run_dir(), "memory_snapshot_failed")
    assert "step 8 does not match its sha256: dropped, not restored" in dropped["message"]


def test_a_classifier_logs_accuracy_beside_the_loss(spec_factory) -> None:
    val = ex.classification_data(64, seed=9)
    spec = spec_factory(tracking="jsonl")
    trainer, result = run(spec, val_data=val)
    trainer.model.eval()
    with torch.no_grad():
        inputs = torch.stack([val[i][0] for i in range(len(val))])
        labels = torch.tensor([int(val[i][1]) for i in range(len(val))])
        want = float((trainer.model(inputs).argmax(-1) == labels).float().mean())
    assert result.metrics["val_accuracy"] == pytest.approx(want)
    steps = [e for e in read_metrics(spec.resolved_run_dir()) if e["event"] == "metrics" and "loss" in e]
    assert len(steps) == 16 and all(0.0 <= e["accuracy"] <= 1.0 for e in steps)
    # 32 samples a step: accuracy is a count of right answers out of 32.
    assert all(abs(e["accuracy"] * 32 - round(e["accuracy"] * 32)) < 1e-9 for e in steps)
    assert steps[-1]["accuracy"] > steps[0]["accuracy"]  # it learns


def test_a_regression_logs_no_accuracy(spec_factory) -> None:
    spec = spec_factory(tracking="jsonl", loss="mse", max_steps=2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    _, result = run(spec, model=lambda: ex.mlp(out_features=1), data=lambda: data, val_data=None)
    assert "accuracy" not in result.metrics and "val_accuracy" not in result.metrics


def test_a_finished_run_is_already_complete_and_fresh_keeps_it(spec_factory) -> None:
    from gpuyard.train.launch import _keep_aside, already_complete

    spec = spec_factory(tracking="jsonl")
    run(spec)
    run_dir = spec.resolved_run_dir()
    done = already_complete(spec, run_dir)
    assert done is not None and done["step"] == 16 and done["already_complete"]
    assert already_complete(spec.model_copy(update={"epochs": 3}), run_dir) is None  # more to train
    assert already_complete(spec.model_copy(update={"max_steps": 20, "epochs": 9}), run_dir) is None
    kept = _keep_aside(run_dir)
    assert kept is not None and kept.name.startswith(f"{run_dir.name}.prev-") and not run_dir.exists()
    assert (kept / "status.json").is_file()


def test_final_lines_say_what_happened() -> None:
    from gpuyard.cli.train import final_line

    line = final_line(
        {
            "status": "completed",
            "step": 14,
            "checkpoint": "/r/checkpoints/step-000000014",
            "metrics": {"loss": 0.5, "val_accuracy": 0.875},
            "notes": ["resumed from step 4 after setting aside step 8 (x.distcp has 3 bytes)"],
        },
        0,
    )
    assert line == (
        "completed at step 14 (/r/checkpoints/step-000000014); loss 0.5, val_accuracy 0.875; "
        "resumed from step 4 after setting aside step 8 (x.distcp has 3 bytes); exit 0"
    )
    failed = {
        "status": "failed",
        "step": 8,
        "error": "disk full at /d/run/ckpt",
        "unrecoverable": True,
    }
    assert final_line(failed, 74) == "failed at step 8: disk full at /d/run/ckpt; exit 74"
    done = {"status": "completed", "step": 12, "already_complete": True, "checkpoint": "/c"}
    assert final_line(done, 0).startswith("already complete at step 12; nothing to train")


def test_the_spec_folder_is_on_the_import_path(tmp_path: Path) -> None:
    from gpuyard.train.launch import LaunchConfig, prepare

    (tmp_path / "shapes_for_test_import.py").write_text(
        "from gpuyard.train.examples import mlp\n\ndef make():\n    return mlp()\n"
    )
    spec = {
        "model": "shapes_for_test_import:make",
        "data": {"train": "gpuyard.train.examples:classification_data"},
        "run_dir": str(tmp_path / "run"),
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    parsed, _ = prepare(LaunchConfig(spec_path=tmp_path / "spec.yaml"))
    assert parsed.model is not None and parsed.model.entrypoint == "shapes_for_test_import:make"
