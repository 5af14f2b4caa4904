"""`gpuyard fabric storage-bench`: measuring a tier in a folder, safely, within bounds, into the plan."""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric import storage_bench as sb
from gpuyard.fabric.calibrate import Calibration, add_storage, load_calibration
from gpuyard.fabric.storage import MAX_TIER_FILE_BYTES, load_tier
from gpuyard.fabric.storage_bench import (
    BenchConfig,
    StorageMeasurement,
    filesystem_of,
    guess_kind,
    resolve_target,
    run_storage_bench,
)

pytestmark = pytest.mark.unit

SMALL = BenchConfig(size_bytes=2 << 20, block_bytes=64 << 10, max_seconds=20.0, random_reads=200, fsyncs=10)


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "target, says",
    [
        ("/proc", "kernel file system"),
        ("/proc/self", "kernel file system"),
        ("/sys/kernel", "kernel file system"),
        ("/dev", "kernel file system"),
        ("s3://bucket/prefix", "mounted folder, not s3:// URLs"),
        ("https://example.com/data", "mounted folder, not https:// URLs"),
        ("file://otherhost/data", "only this host's files"),
        ("", "needs a folder"),
        ("/no/such/folder/anywhere", "does not exist"),
    ],
)
def test_unsafe_or_meaningless_targets_are_refused_in_one_line(target: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_target(target)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_file_and_a_link_into_proc_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        resolve_target(str(f))
    link = tmp_path / "innocent"
    link.symlink_to("/proc/sys")
    with pytest.raises(ConfigError, match="under /proc"):  # resolved before it is judged
        resolve_target(str(link))


def test_a_file_url_and_a_plain_folder_resolve(tmp_path: Path) -> None:
    assert resolve_target(f"file://{tmp_path}") == tmp_path.resolve()
    assert resolve_target(str(tmp_path)) == tmp_path.resolve()


def test_filesystem_is_the_longest_mount_holding_the_path() -> None:
    info = "\n".join(
        [
            "22 1 8:1 / / rw - ext4 /dev/sda1 rw",
            "30 22 0:5 / /mnt/fast\\040disk rw - xfs /dev/nvme0n1 rw",
            "31 22 0:6 / /mnt/lus rw - lustre 10.0.0.1@o2ib:/fs rw",
            "32 22 0:7 / /mnt/lus rw - tmpfs tmpfs rw",  # mounted over it: the later one is visible
            "garbage line",
        ]
    )
    assert filesystem_of(Path("/mnt/fast disk/x"), info) == "xfs"
    assert filesystem_of(Path("/mnt/fastdisk"), info) == "ext4"  # a prefix of the name is not the mount
    assert filesystem_of(Path("/mnt/lus/a"), info) == "tmpfs"
    assert filesystem_of(Path("/home"), info) == "ext4"
    assert guess_kind("lustre") == "parallel-fs"
    assert guess_kind("fuse.mountpoint-s3") == "object-store"
    assert guess_kind("xfs") == "local-nvme"


@pytest.mark.parametrize(
    "cfg, says",
    [
        (BenchConfig(size_bytes=1000), "--size"),
        (BenchConfig(size_bytes=128 << 30), "--size"),
        (BenchConfig(block_bytes=1000), "--block"),
        (BenchConfig(block_bytes=128 << 20), "--block"),
        (BenchConfig(size_bytes=2 << 20, block_bytes=4 << 20), "larger than --size"),
        (BenchConfig(max_seconds=0.1), "--max-seconds"),
        (BenchConfig(max_seconds=3600), "--max-seconds"),
        (BenchConfig(random_reads=0), "random reads"),
        (BenchConfig(fsyncs=10**6), "fsyncs"),
    ],
)
def test_sizes_and_time_are_bounded(cfg: BenchConfig, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        cfg.check()


def test_a_run_measures_every_phase_and_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    m = run_storage_bench(tmp_path, SMALL)
    assert _entries(tmp_path) == ["keep.txt"]  # its private folder is gone, the member's file untouched
    assert m.file_bytes == SMALL.size_bytes and m.truncated == []
    assert m.random_reads <= 200 and m.fsyncs <= 10  # the count bounds hold as well as the time
    assert m.seq_write_GBps > 0 and m.seq_read_GBps > 0
    assert m.random_reads >= 1 and m.random_read_iops > 0
    assert m.fsyncs >= 1 and m.fsync_p99_ms >= m.fsync_p50_ms >= 0
    assert m.random_read_p99_ms >= m.random_read_p50_ms
    tier = m.tier("scratch", "local-nvme")
    assert tier.read_GBps_per_node == m.seq_read_GBps and tier.write_GBps_per_node == m.seq_write_GBps
    assert tier.read_GBps_aggregate is None and tier.write_GBps_aggregate is None  # one node cannot say
    assert "storage-bench" in tier.source


def test_the_time_budget_cuts_phases_short_and_says_so(tmp_path: Path) -> None:
    ticks = itertools.count()
    m = run_storage_bench(tmp_path, SMALL, clock=lambda: float(next(ticks)))  # one second a call
    assert m.truncated == ["write", "read"]
    assert 0 < m.file_bytes < SMALL.size_bytes
    assert 1 <= m.random_reads <= 2 and 1 <= m.fsyncs <= 2  # each stops at its share of the budget
    assert any("cut short by the time budget: write, read" in line for line in m.lines())
    assert _entries(tmp_path) == []


def test_an_io_error_is_one_line_and_the_folder_is_still_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sb.os, "fsync", failing_fsync)
    with pytest.raises(ConfigError) as info:
        run_storage_bench(tmp_path, SMALL)
    assert "storage-bench write" in str(info.value) and "Input/output error" in str(info.value)
    assert "\n" not in str(info.value)
    assert _entries(tmp_path) == []


def test_too_little_free_space_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.statvfs(tmp_path)

    class Tiny:
        f_bavail, f_frsize = 10, real.f_frsize

    monkeypatch.setattr(sb.os, "statvfs", lambda p: Tiny)
    with pytest.raises(ConfigError, match="MiB free"):
        run_storage_bench(tmp_path, SMALL)
    assert _entries(tmp_path) == []


def _measurement(**over: object) -> StorageMeasurement:
    doc: dict[str, object] = {
        "path": "/scratch",
        "filesystem": "tmpfs",
        "host": "h",
        "created": "2026-11-29T00:00:00+00:00",
        "file_bytes": 1 << 20,
        "block_bytes": 1 << 16,
        "seq_write_GBps": 2.0,
        "seq_read_GBps": 4.0,
        "random_reads": 10,
        "random_read_iops": 1000.0,
        "random_read_p50_ms": 0.1,
        "random_read_p99_ms": 0.5,
        "fsyncs": 5,
        "fsync_p50_ms": 1.0,
        "fsync_p99_ms": 2.0,
        "memory_backed": True,
        "cache_dropped": False,
        **over,
    }
    return StorageMeasurement.model_validate({"seconds": 1.0, **doc})


def test_memory_backed_and_undropped_caches_are_said() -> None:
    text = "\n".join(_measurement().lines())
    assert "these are memory figures" in text
    assert "may be the page cache" in text


def test_a_measured_tier_goes_into_a_calibration_file_and_into_the_plan(tmp_path: Path) -> None:
    from tests.unit.fabric.test_calibration import _calibration

    cal_path = tmp_path / "calibration.json"
    with pytest.raises(ConfigError, match="run gpuyard fabric calibrate first"):
        add_storage(cal_path, "nvme", "local-nvme", _measurement())
    cal: Calibration = _calibration()
    cal_path.write_text(cal.model_dump_json(indent=2))
    with pytest.raises(ConfigError, match="holds no measured storage tier"):
        load_tier(str(cal_path))
    add_storage(cal_path, "nvme", "local-nvme", _measurement())
    assert load_calibration(cal_path).storage["nvme"].kind == "local-nvme"
    tier = load_tier(str(cal_path))
    assert (tier.name, tier.kind, tier.read_GBps_per_node) == ("nvme", "local-nvme", 4.0)
    add_storage(cal_path, "lustre", "parallel-fs", _measurement(seq_read_GBps=9.0))
    with pytest.raises(ConfigError, match="holds tiers lustre, nvme"):
        load_tier(str(cal_path))
    assert load_tier(f"{cal_path}#lustre").read_GBps_per_node == 9.0
    with pytest.raises(NotFoundError, match="holds no tier 'gpfs'"):
        load_tier(f"{cal_path}#gpfs")
    # The rest of the calibration is kept as it was.
    assert load_calibration(cal_path).gemm_fit == cal.gemm_fit
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]  # no temporary file left


def test_the_command_measures_writes_a_tier_file_the_plan_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "tier"
    target.mkdir()
    out = tmp_path / "tier.json"
    args = ["fabric", "storage-bench", str(target), "--size", "2MiB", "--block", "64KiB"]
    args += ["--max-seconds", "1"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--kind", "parallel-fs", "--out", str(out)])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "sequential write" in text and "tier tier: parallel-fs" in text
    assert _entries(target) == []
    tier = load_tier(str(out))
    assert tier.kind == "parallel-fs" and tier.write_GBps_per_node and tier.write_GBps_per_node > 0
    with pytest.raises(SystemExit) as info:
        main([*args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["file_bytes"] == 2 << 20 and doc["kind"] in ("local-nvme", "parallel-fs", "object-store")


@pytest.mark.parametrize(
    "extra, says",
    [
        (["/proc"], "kernel file system"),
        (["{tmp}", "--kind", "tape"], "--kind 'tape'"),
        (["{tmp}", "--name", "a#b"], "--name"),
        (["{tmp}", "--size", "1KiB"], "--size"),
        (["{tmp}", "--out", "{tmp}/missing/tier.json"], "does not exist"),
    ],
)
def test_the_command_refuses_in_one_line_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    with pytest.raises(SystemExit) as info:
        main(["fabric", "storage-bench", *args])
    assert info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert _entries(tmp_path) == []


def test_sigterm_mid_run_ends_through_the_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    real_fsync = os.fsync
    before = signal.getsignal(signal.SIGTERM)

    def fsync_then_terminated(fd: int) -> None:
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would, while the file is on disk

    monkeypatch.setattr(sb.os, "fsync", fsync_then_terminated)
    with pytest.raises(SystemExit) as info:
        run_storage_bench(tmp_path, SMALL)
    assert info.value.code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM: its folder is removed" in capsys.readouterr().err
    assert _entries(tmp_path) == []  # the private folder and its 2 MiB file are gone
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def test_a_full_size_calibration_file_is_read_past_the_tier_file_limit(tmp_path: Path) -> None:
    from tests.unit.fabric.test_calibration import _calibration

    points = [{"dtype": "float32", "m": i, "n": i, "k": i, "tflops": 0.05} for i in range(1, 2000)]
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(_calibration(gemm=points).model_dump_json(indent=2))
    add_storage(cal_path, "nvme", "local-nvme", _measurement())
    assert cal_path.stat().st_size > MAX_TIER_FILE_BYTES  # GEMM points and collectives make it large
    assert load_tier(str(cal_path)).name == "nvme"
    big_tier = tmp_path / "big.json"  # a tier file that large is still refused
    big_tier.write_text('{"kind": "local-nvme", "source": "' + "x" * MAX_TIER_FILE_BYTES + '"}')
    with pytest.raises(ConfigError, match="at most"):
        load_tier(str(big_tier))
