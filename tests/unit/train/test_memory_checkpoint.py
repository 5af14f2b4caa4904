"""In-memory checkpoints in one process: the restore plan, crash -> resume from host memory (bit-equal),
background persists to storage, fallback to storage when the snapshots are gone, spec checks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuyard.errors import ConfigError
from gpuyard.tracking.files import read_metrics
from gpuyard.train.checkpoint import latest_checkpoint, list_checkpoints, read_marker
from gpuyard.train.memory_checkpoint import (
    SNAPSHOT_DIR_ENV,
    Holding,
    fill,
    parse_name,
    plan_restore,
    snapshot_name,
)
from gpuyard.train.spec import parse_spec
from gpuyard.train.trainer import Trainer

from .conftest import run, weights

pytestmark = pytest.mark.unit

MEMORY = {"every_steps": 0, "at_epoch_end": False, "memory_every": 2}


class Crash(RuntimeError):
    """What the test callback raises to end a run the way a dead process would (no checkpoint)."""


def crash_at(step: int) -> Any:
    def callback(trainer: Trainer, event: str) -> None:
        if event == "step" and trainer.step == step:
            assert trainer.memory is not None
            trainer.memory.wait()  # the last snapshot's background work is done, as in a real failure later
            raise Crash(f"crash at step {step}")

    return callback


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's snapshot folder, as the launcher hands it to the ranks."""
    folder = tmp_path / "shm"
    monkeypatch.setenv(SNAPSHOT_DIR_ENV, str(folder))
    return folder


def _resumes(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_metrics(run_dir) if e["event"] == "resume"]


def test_plan_prefers_the_newest_step_every_rank_can_get() -> None:
    h = Holding
    inventories = [
        [h(0, 4, 2), h(0, 6, 2), h(1, 4, 2), h(1, 6, 2)],  # rank 0: its own and rank 1's replica
        [h(1, 4, 2)],  # rank 1 lost step 6 (killed while writing it)
    ]
    assert plan_restore(inventories, 2, storage_step=-1) == (6, {0: 0, 1: 0})
    # Storage newer than every snapshot: storage wins; as new: memory (faster).
    assert plan_restore(inventories, 2, storage_step=8) is None
    assert plan_restore(inventories, 2, storage_step=6) == (6, {0: 0, 1: 0})
    # Rank 1's state at step 6 held nowhere: the newest complete step is 4, rank 1 from its own.
    assert plan_restore([[h(0, 6, 2), h(0, 4, 2), h(1, 4, 2)], [h(1, 4, 2)]], 2, -1) == (4, {0: 0, 1: 1})
    # Snapshots of another world size are never used; nothing held is a fresh start.
    assert plan_restore([[h(0, 6, 4)], [h(1, 6, 4)]], 2, -1) is None
    assert plan_restore([[], []], 2, -1) is None


def test_snapshot_names_round_trip() -> None:
    holding = Holding(owner=3, step=120, world_size=8, slot=1)
    assert parse_name(snapshot_name(holding)) == holding
    assert parse_name(snapshot_name(holding)).slot == 1  # type: ignore[union-attr]
    assert parse_name(".tmp-" + snapshot_name(holding)) is None


def test_fill_copies_in_place_and_refuses_another_shape() -> None:
    live = {"w": torch.zeros(3), "groups": [{"lr": 0.1}]}
    target = live["w"]
    out = fill(live, {"w": torch.ones(3), "groups": [{"lr": 0.5}]})
    assert out["w"] is target and torch.equal(target, torch.ones(3))
    assert out["groups"][0]["lr"] == 0.5
    with pytest.raises(ValueError, match="/w"):
        fill(live, {"w": torch.ones(4), "groups": [{"lr": 0.5}]})


def test_crash_resumes_from_host_memory_bit_equal(spec_factory, shm: Path) -> None:
    whole_t, whole = run(spec_factory("whole", checkpoint=MEMORY))
    spec = spec_factory("crashed", checkpoint=MEMORY)
    with pytest.raises(Crash):
        run(spec, callbacks=[crash_at(7)])
    assert latest_checkpoint(spec.resolved_run_dir() / "checkpoints") is None  # nothing on storage
    resumed, second = run(spec)
    assert resumed.resumed_source == "memory"
    [event] = _resumes(spec.resolved_run_dir())
    assert event["step"] == 6 and event["source"] == "memory" and event["ranks"] == {"0": "memory"}
    assert second.status == "completed" and second.step == whole.step
    for key, value in weights(whole_t).items():
        assert torch.equal(weights(resumed)[key], value), key
    # A run that ended on its own drops its snapshots.
    assert not any(shm.rglob("*.snap"))


def test_persisted_snapshot_is_an_ordinary_checkpoint_and_the_fallback(spec_factory, shm: Path) -> None:
    whole_t, _ = run(spec_factory("whole"))
    spec = spec_factory("crashed", checkpoint={**MEMORY, "persist_every": 4, "keep": 5})
    with pytest.raises(Crash):
        run(spec, callbacks=[crash_at(11)])
    root = spec.resolved_run_dir() / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-000000004", "step-000000008"]
    assert read_marker(list_checkpoints(root)[-1])["reason"] == "persist_every"
    # The node is gone with its memory: the restart resumes from the persisted step 8.
    shutil.rmtree(shm)
    resumed, _ = run(spec)
    [event] = _resumes(spec.resolved_run_dir())
    assert event["source"] == "storage" and event["step"] == 8
    assert resumed.resumed_from == root / "step-000000008"
    for key, value in weights(whole_t).items():
        assert torch.equal(weights(resumed)[key], value), key


def test_memory_newer_than_storage_wins(spec_factory, shm: Path) -> None:
    spec = spec_factory("crashed", checkpoint={**MEMORY, "persist_every": 4})
    with pytest.raises(Crash):
        run(spec, callbacks=[crash_at(7)])
    run(spec)
    [event] = _resumes(spec.resolved_run_dir())
    assert event == {**event, "source": "memory", "step": 6, "storage_step": 4}


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"persist_every": 4}, "persist_every needs memory_every"),
        ({"memory_every": 3, "persist_every": 4}, "must be a multiple of memory_every=3"),
        ({"memory_every": -1}, "checkpoint.memory_every"),
    ],
)
def test_spec_checks_the_memory_options(checkpoint: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec({"checkpoint": checkpoint})


def test_with_async_storage_saves_too(spec_factory, shm: Path) -> None:
    """Epoch-end async DCP saves and background persists share the folder: both complete, resume exact."""
    whole_t, _ = run(spec_factory("whole"))
    checkpoint = {**MEMORY, "persist_every": 4, "async_save": True, "at_epoch_end": True, "keep": 5}
    spec = spec_factory("crashed", checkpoint=checkpoint)
    with pytest.raises(Crash):
        run(spec, callbacks=[crash_at(13)])
    root = spec.resolved_run_dir() / "checkpoints"
    # 4 and 12 persisted from memory, 8 (the epoch end, persisted too) and nothing torn.
    assert [p.name for p in list_checkpoints(root)] == ["step-000000004", "step-000000008", "step-000000012"]
    assert not list(root.glob(".tmp-*"))
    resumed, _ = run(spec)
    [event] = _resumes(spec.resolved_run_dir())
    assert event["source"] == "memory" and event["step"] == 12
    for key, value in weights(whole_t).items():
        assert torch.equal(weights(resumed)[key], value), key


def test_launcher_folder_is_private_and_those_of_dead_launchers_are_removed(tmp_path: Path) -> None:
    import stat
    import subprocess
    import sys

    from gpuyard.train.launch import LAUNCH_PREFIX, launch_dir

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone, alive, other = (tmp_path / f"{LAUNCH_PREFIX}{n}" for n in ("gone", "alive", "other"))
    for folder, pid in ((gone, dead.stdout.strip()), (alive, "1"), (other, "x")):  # pid 1 always runs
        (folder / "snapshots").mkdir(parents=True)
        folder.chmod(0o700)
        (folder / "launcher.pid").write_text(pid)
    first, second = launch_dir(tmp_path), launch_dir(tmp_path)
    assert first != second and first.name.startswith(LAUNCH_PREFIX)  # random names, not the pid
    for mine in (first, second):
        st = mine.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert (mine / "launcher.pid").read_text() == str(os.getpid())
    assert not gone.exists() and alive.exists() and other.exists()


def test_a_snapshot_that_cannot_be_written_is_reported_and_training_goes_on(
    spec_factory, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if Path(getattr(f, "name", "")).name.startswith(".tmp-o0-s000000006"):
            f.write(b"half")  # then the device is full
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    spec = spec_factory("crashed", checkpoint=MEMORY)
    with pytest.raises(Crash):
        run(spec, callbacks=[crash_at(9)])
    events = read_metrics(spec.resolved_run_dir())
    # Reported once the training thread next looks (the snapshot of step 8 waits for step 6's work).
    [failed] = [e for e in events if e["event"] == "memory_snapshot_failed"]
    assert "step 6: rank 0 could not write its snapshot" in failed["message"]
    assert not list(shm.rglob(".tmp-*"))  # the half-written file is gone
    # Steps 4 and 8 are held (in the two slots; step 6's data went into step 2's slot, undescribed).
    assert sorted(p.name for p in shm.rglob("*.snap")) == [
        "o0-s000000004-w1-g1.snap",
        "o0-s000000008-w1-g0.snap",
    ]
    run(spec)
    [event] = _resumes(spec.resolved_run_dir())
    assert event["source"] == "memory" and event["step"] == 8


def test_update_only_tensors_are_copied_before_the_next_update(tmp_path: Path) -> None:
    from gpuyard.train.memory_checkpoint import MemoryCheckpointer, read_snapshot

    memory = MemoryCheckpointer(tmp_path / "shm", rank=0, world_size=1)
    param, buffer = torch.arange(4.0), torch.zeros(2)
    memory.snapshot(1, {"p": param, "b": buffer}, {"step": 1}, {}, defer={param.data_ptr()})
    buffer += 5  # what a forward pass does to BatchNorm statistics: copied at once, not affected
    memory.before_update()
    assert 1 in memory.copy_waits
    param.mul_(-1)  # the optimizer step, after before_update()
    memory.wait()
    [held] = memory.inventory()
    saved = read_snapshot(*memory._read_local(held))["app"]
    assert torch.equal(saved["p"], torch.arange(4.0)) and torch.equal(saved["b"], torch.zeros(2))


def test_a_reused_layout_follows_the_state_and_a_changed_one_is_laid_out_anew(tmp_path: Path) -> None:
    from gpuyard.train.memory_checkpoint import MemoryCheckpointer, read_snapshot

    memory = MemoryCheckpointer(tmp_path / "shm", rank=0, world_size=1)
    w, rng = torch.arange(6.0), (3, tuple(range(10)), None)
    for step in (1, 2, 3):  # same tensors: the layout of the first snapshot is reused
        w.add_(1)
        memory.snapshot(step, {"w": w, "lr": 0.1 * step}, {"rng": rng, "t": torch.tensor([step])}, {})
        memory.wait()
    memory.snapshot(4, {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.arange(3)}, {"s": 4}, {})
    memory.wait()
    threads = memory._workers
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    newest, older = sorted(memory.inventory(), reverse=True)
    app = read_snapshot(*memory._read_local(newest))["app"]
    assert app["w"].dtype == torch.float64 and torch.equal(app["w"], torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(app["b"], torch.arange(3))
    snap = read_snapshot(*memory._read_local(older))
    assert torch.equal(snap["app"]["w"], torch.arange(6.0) + 3) and snap["app"]["lr"] == pytest.approx(0.3)
    assert snap["rank_state"]["rng"] == rng and torch.equal(snap["rank_state"]["t"], torch.tensor([3]))
    restored = memory.restore(-1)
    assert restored is not None and restored.step == 4
    memory.close()
    assert not any(t.is_alive() for t in threads)


def test_an_unclosed_checkpointer_once_collected_ends_its_workers(tmp_path: Path) -> None:
    import gc

    from gpuyard.train.memory_checkpoint import MemoryCheckpointer

    memory = MemoryCheckpointer(tmp_path / "shm", rank=0, world_size=1)
    memory.snapshot(1, {"w": torch.arange(4.0)}, {}, {})
    memory.wait()  # a crashed run: never closed
    threads = memory._workers
    del memory
    gc.collect()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
