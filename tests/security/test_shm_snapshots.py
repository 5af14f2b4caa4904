"""In-memory snapshots stay private: paths planted in advance in /dev/shm are refused, never used.

The attack of issue 26: another team pre-creates the snapshot folders (and files) a run will use,
owned by itself and writable by all, and reads (or changes) the weights written into them. The
launcher's folders now have random names made with O_EXCL; the predictable one a rank uses without
a launcher, and every folder a restore reads, must be this user's own, mode 0700, not a link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from gpuyard.errors import PermissionDenied
from gpuyard.train.launch import LAUNCH_PREFIX, launch_dir
from gpuyard.train.memory_checkpoint import MemoryCheckpointer, default_snapshot_dir

pytestmark = pytest.mark.security

NOBODY = 65534


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("planting a folder owned by another user needs root (CI has it)")


def _nothing_written(folder: Path) -> None:
    assert [p for p in folder.rglob("*")] == [], sorted(folder.rglob("*"))


def test_a_folder_planted_by_another_user_is_refused_and_never_written(tmp_path: Path) -> None:
    _as_root()
    planted = tmp_path / "gpuyard-snap-planted"
    planted.mkdir()
    planted.chmod(0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(PermissionDenied) as caught:
        MemoryCheckpointer(planted, rank=0, world_size=1)
    owner = f"belongs to uid {NOBODY}, not this user ({os.getuid()})"
    assert str(caught.value) == f"{planted}: snapshot folder {owner}: refused, never used"
    _nothing_written(planted)


def test_a_planted_link_or_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "attacker"
    target.mkdir(mode=0o700)
    link = tmp_path / "gpuyard-snap-link"
    link.symlink_to(target)
    with pytest.raises(PermissionDenied, match=f"^{link}: snapshot folder is a link"):
        MemoryCheckpointer(link, rank=0, world_size=1)
    _nothing_written(target)
    shared = tmp_path / "gpuyard-snap-shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionDenied, match="has mode 777, not 700"):
        MemoryCheckpointer(shared, rank=0, world_size=1)
    _nothing_written(shared)


def test_the_predictable_folder_without_a_launcher_is_refused_when_planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_root()
    monkeypatch.delenv("GPUYARD_SNAPSHOT_DIR", raising=False)
    predictable = default_snapshot_dir(tmp_path / "run")  # what an attacker can compute too
    try:
        predictable.mkdir(mode=0o777)
        predictable.chmod(0o777)
        os.chown(predictable, NOBODY, NOBODY)
        (predictable / "holder-0").mkdir()
        with pytest.raises(PermissionDenied, match=f"^{predictable}: snapshot folder belongs to uid"):
            MemoryCheckpointer(predictable, rank=0, world_size=1)
        assert os.listdir(predictable / "holder-0") == []
    finally:
        import shutil

        shutil.rmtree(predictable, ignore_errors=True)


def test_launch_folders_have_random_private_names_whatever_was_planted(tmp_path: Path) -> None:
    _as_root()
    pid = os.getpid()
    # Everything the old scheme would have used, and then some, planted by another user.
    for n in range(pid, pid + 50):
        for name in (f"gpuyard-snap-launch-{n}", f"{LAUNCH_PREFIX}{n}"):
            (tmp_path / name).mkdir(mode=0o777)
            os.chown(tmp_path / name, NOBODY, NOBODY)
    folders = {launch_dir(tmp_path) for _ in range(5)}
    assert len(folders) == 5
    for folder in folders:
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert sorted(os.listdir(folder)) == ["launcher.pid"]
    for n in range(pid, pid + 50):  # the planted ones are left alone (not ours to remove)
        assert os.lstat(tmp_path / f"{LAUNCH_PREFIX}{n}").st_uid == NOBODY


def test_a_restore_reads_only_from_a_private_folder(tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    memory = MemoryCheckpointer(folder, rank=0, world_size=1)
    memory.snapshot(2, {"w": torch.arange(8.0)}, {"step": 2}, {})
    memory.wait()
    assert memory.restore(-1) is not None
    folder.chmod(0o755)  # opened up (by a mistake or an attacker with our uid's help): not trusted
    with pytest.raises(PermissionDenied, match="has mode 755, not 700"):
        memory.restore(-1)
    folder.chmod(0o700)
    data = next((folder / "holder-0").glob("o0-slot*.bin"))
    data.unlink()
    data.symlink_to(tmp_path / "elsewhere.bin")  # a file replaced by a link: not followed
    (tmp_path / "elsewhere.bin").write_bytes(bytes(64))
    assert memory.restore(-1) is None
    assert any("unreadable" in w and "dropped, not restored" in w for w in memory.warnings)
