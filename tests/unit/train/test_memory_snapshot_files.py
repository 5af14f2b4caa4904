"""In-memory snapshots' data files: allocated ahead of the first snapshot (off the training step), never
touched while they hold a complete snapshot, and a rank killed in the middle of a copy leaves the
previous snapshot whole for the restore."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpuyard.train.memory_checkpoint import MemoryCheckpointer, read_snapshot
from gpuyard.train.snapshot_files import data_name

pytestmark = pytest.mark.unit


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A snapshot folder in /dev/shm where there is one (where a file's allocated pages show in its
    ``st_blocks``), else in the test's temporary folder."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else str(tmp_path)
    folder = Path(tempfile.mkdtemp(prefix="gpuyard-test-snap-", dir=base))
    yield folder / "snap"
    shutil.rmtree(folder, ignore_errors=True)


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_the_state_is_laid_out_and_allocated_at_the_second_update_before_any_snapshot(shm: Path) -> None:
    w, m = torch.arange(300_000.0), torch.zeros(200_000)
    asked: list[int] = []

    def state() -> dict[str, torch.Tensor]:
        asked.append(1)
        return {"w": w, "m": m}

    memory = MemoryCheckpointer(shm, rank=0, world_size=1, state=state)
    memory.before_update()  # the first update: the optimizer may not have its state yet
    assert not asked and not list(memory.holder_dir.iterdir())
    memory.before_update()
    assert asked == [1]
    memory._wait_ready()
    size = (300_000 + 200_000) * 4
    for slot in (0, 1):
        path = memory.holder_dir / data_name(0, slot)
        assert path.stat().st_size == size
        if str(shm).startswith("/dev/shm"):
            assert _allocated(path) >= size  # its pages are there before the first copy
    mapped = memory._stores[(0, 0)]
    memory.before_update()  # once only
    assert asked == [1]
    w.add_(1)
    memory.snapshot(1, {"w": w, "m": m}, {}, {}, defer={w.data_ptr(), m.data_ptr()})
    memory.before_update()
    memory.wait()
    assert memory._stores[(0, 0)] is mapped  # the first snapshot went into the prepared mapping
    [held] = memory.inventory()
    saved = read_snapshot(*memory._read_local(held))["app"]
    assert torch.equal(saved["w"], torch.arange(300_000.0) + 1) and torch.equal(saved["m"], m)
    memory.close()


def test_preparing_leaves_a_slot_that_holds_a_snapshot_whole(shm: Path) -> None:
    first = MemoryCheckpointer(shm, rank=0, world_size=1)
    first.snapshot(5, {"w": torch.arange(1000.0)}, {"s": 5}, {})
    first.wait()  # then the rank dies: its snapshot stays in the folder
    held_before = first.inventory()
    del first
    # The restarted rank, a larger state (another layout): only the free slot is laid out anew.
    again = MemoryCheckpointer(shm, rank=0, world_size=1)
    again.prepare({"w": torch.zeros(5000)})
    again._wait_ready()
    assert again.inventory() == held_before
    assert (again.holder_dir / data_name(0, 0)).stat().st_size == 1000 * 4
    assert (again.holder_dir / data_name(0, 1)).stat().st_size == 5000 * 4
    restored = again.restore(-1)
    assert restored is not None and restored.step == 5
    assert torch.equal(restored.app["w"], torch.arange(1000.0))
    again.close()


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    from gpuyard.train.memory_checkpoint import MemoryCheckpointer

    def die_halfway(self, *job):
        dst, src = job[7][0]  # the first of the deferred copies done, then the rank is killed
        dst.copy_(src)
        os._exit(9)

    memory = MemoryCheckpointer(sys.argv[1], rank=0, world_size=1, state=None)
    a, b = torch.zeros(50_000), torch.zeros(50_000)
    for step in (1, 2):  # complete: step 1 in slot 0, step 2 in slot 1
        a.fill_(step), b.fill_(step)
        memory.snapshot(step, {"a": a, "b": b}, {"step": step}, {}, defer={a.data_ptr(), b.data_ptr()})
        memory.before_update()
        memory.wait()
    MemoryCheckpointer._copy_job = die_halfway
    a.fill_(3), b.fill_(3)
    memory.snapshot(3, {"a": a, "b": b}, {"step": 3}, {}, defer={a.data_ptr(), b.data_ptr()})
    memory.before_update()  # never returns: the process ends inside the copy
    """
)


def test_a_rank_killed_in_the_middle_of_a_copy_leaves_the_previous_snapshot_whole(shm: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASH, str(shm)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 9, done.stderr
    # Step 3 was going into slot 0 (step 1's): half of it is there, and step 1's description is gone.
    slot0 = torch.from_file(str(shm / "holder-0" / data_name(0, 0)), size=100_000, dtype=torch.float32)
    assert torch.all(slot0[:50_000] == 3) and torch.all(slot0[50_000:] == 1)
    memory = MemoryCheckpointer(shm, rank=0, world_size=1)
    assert [h.step for h in memory.inventory()] == [2]
    restored = memory.restore(-1)
    assert restored is not None and restored.step == 2 and restored.rank_state == {"step": 2}
    assert torch.all(restored.app["a"] == 2) and torch.all(restored.app["b"] == 2)
    memory.close()
