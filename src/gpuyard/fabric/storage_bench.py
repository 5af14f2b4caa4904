"""Measuring a storage tier: ``gpuyard fabric storage-bench PATH``.

A tier is measured through a folder on it (a local NVMe mount, a parallel file system mount, an object
store mounted with its FUSE client). In a private folder it creates there (mode 0700, removed again
whatever happens), it measures, each phase within its share of a time budget:

* **sequential write**: one file of ``size`` bytes in ``block``-byte writes of random data (incompressible),
  then ``fsync``; the rate counts the fsync, so it is what reaches the device, not the page cache;
* **sequential read**: the file read back after ``posix_fadvise(DONTNEED)`` has dropped its cached pages
  (a file system that ignores the advice, or one held in memory, is said so);
* **random reads**: 4 KiB ``pread`` at random aligned offsets of the file (cache dropped again): IOPS and
  the median and 99th-percentile latency, the tier's first-byte latency for a loader;
* **fsync**: 4 KiB written then ``fsync`` in a loop: what a synchronous checkpoint's commit waits for.

The result becomes a :class:`gpuyard.fabric.storage.StorageTier` (per-node read and write rates and the
random-read latency; a single node cannot measure an aggregate, so none is stated) that
``gpuyard plan --storage`` takes, from a tier file (``--out``) or from the ``storage`` section of a
calibration file (``--calibration``).

Paths are refused in one line where measuring would be unsafe or meaningless: kernel pseudo file
systems (/proc, /sys, /dev and their kin), anything that is not a writable folder, a folder without room
for the file; URLs other than ``file://`` (gpuyard reads object stores through a mount, not their API).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field

from gpuyard.errors import ConfigError
from gpuyard.fabric.storage_tier import StorageTier

MIN_SIZE = 1 << 20  # 1 MiB: below this a rate is a measurement of system-call overhead
MAX_SIZE = 64 << 30  # 64 GiB: bounded, whatever a member asks
MIN_BLOCK, MAX_BLOCK = 4096, 64 << 20
MAX_SECONDS = 600.0
RANDOM_READ_BYTES = 4096
MAX_RANDOM_READS = 20_000
MAX_FSYNCS = 1_000
FREE_MARGIN = 64 << 20  # left free on the file system beyond the test file
# Share of the time budget each phase may use (a phase cut short says so in ``truncated``).
PHASE_SHARE = {"write": 0.4, "read": 0.3, "random_read": 0.15, "fsync": 0.15}

# Kernel pseudo file systems: writing there changes the kernel or devices, not storage.
PSEUDO_FS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "securityfs",
        "debugfs",
        "tracefs",
        "bpf",
        "pstore",
        "configfs",
        "fusectl",
        "mqueue",
        "hugetlbfs",
        "autofs",
        "binfmt_misc",
        "efivarfs",
        "nsfs",
        "rpc_pipefs",
    }
)
PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
MEMORY_FS = frozenset({"tmpfs", "ramfs"})
PARALLEL_FS = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs", "wekafs"}
)
OBJECT_FS = frozenset(
    {"fuse.mountpoint-s3", "fuse.s3fs", "fuse.goofys", "fuse.gcsfuse", "fuse.rclone", "fuse.blobfuse2"}
)
Kind = Literal["local-nvme", "parallel-fs", "object-store"]


class StorageMeasurement(BaseModel):
    """What one ``storage-bench`` run measured in one folder of a tier (GB/s are 1e9 bytes per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    filesystem: str = Field(description="File system type of the folder (from /proc/self/mountinfo).")
    host: str
    created: str
    file_bytes: int = Field(gt=0, description="Bytes written and read back sequentially.")
    block_bytes: int = Field(gt=0)
    seq_write_GBps: float = Field(gt=0, description="Sequential write rate, fsync included.")
    seq_read_GBps: float = Field(gt=0)
    random_reads: int = Field(gt=0)
    random_read_iops: float = Field(gt=0)
    random_read_p50_ms: float = Field(ge=0)
    random_read_p99_ms: float = Field(ge=0)
    fsyncs: int = Field(gt=0)
    fsync_p50_ms: float = Field(ge=0)
    fsync_p99_ms: float = Field(ge=0)
    memory_backed: bool = Field(description="The folder is on tmpfs/ramfs: memory, not storage.")
    cache_dropped: bool = Field(description="posix_fadvise(DONTNEED) was available to drop cached pages.")
    truncated: list[str] = Field(default_factory=list, description="Phases cut short by the time budget.")
    seconds: float = Field(ge=0)

    def tier(self, name: str, kind: Kind) -> StorageTier:
        """This measurement as a storage tier for ``gpuyard plan --storage`` (per-node figures only)."""
        return StorageTier(
            name=name,
            kind=kind,
            read_GBps_per_node=self.seq_read_GBps,
            write_GBps_per_node=self.seq_write_GBps,
            latency_ms=min(60_000.0, self.random_read_p50_ms),
            source=(
                f"measured by gpuyard fabric storage-bench on {self.host} at {self.created} in "
                f"{self.path} ({self.filesystem}): {self.file_bytes} bytes written in {self.block_bytes}-"
                f"byte blocks then fsync {self.seq_write_GBps:.3g} GB/s, read back {self.seq_read_GBps:.3g}"
                f" GB/s, 4 KiB random reads {self.random_read_iops:.0f}/s (median "
                f"{self.random_read_p50_ms:.3g} ms); one node: aggregate not measured"
                + ("; memory-backed file system" if self.memory_backed else "")
            )[:2000],
        )

    def lines(self) -> list[str]:
        """What the command prints, one figure a line."""
        out = [
            f"{self.path} ({self.filesystem}) on {self.host}: {self.file_bytes / 2**20:.0f} MiB file, "
            f"{self.block_bytes // 1024} KiB blocks, {self.seconds:.1f} s",
            f"sequential write {self.seq_write_GBps:.3g} GB/s (fsync included)",
            f"sequential read {self.seq_read_GBps:.3g} GB/s"
            + ("" if self.cache_dropped else " (cached pages could not be dropped: may be the page cache)"),
            f"random 4 KiB reads {self.random_read_iops:.0f}/s, median {self.random_read_p50_ms:.3g} ms, "
            f"p99 {self.random_read_p99_ms:.3g} ms ({self.random_reads} reads)",
            f"fsync of 4 KiB: median {self.fsync_p50_ms:.3g} ms, p99 {self.fsync_p99_ms:.3g} ms "
            f"({self.fsyncs} fsyncs)",
        ]
        if self.memory_backed:
            out.append(
                f"{self.filesystem} holds files in memory: these are memory figures, not a storage tier's"
            )
        if self.truncated:
            out.append(f"cut short by the time budget: {', '.join(self.truncated)} (figures from what ran)")
        return out


class CalibratedTier(BaseModel):
    """A measured tier as a calibration file keeps it: its kind and the measurement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    measurement: StorageMeasurement


def _unescape_mount(text: str) -> str:
    r"""/proc/self/mountinfo escapes space, tab, newline and backslash as \040, \011, \012, \134."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def filesystem_of(path: Path, mountinfo: str | None = None) -> str:
    """File system type of the mount holding ``path`` (resolved), or ``"unknown"``."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "unknown"
    best, fstype = -1, "unknown"
    target = str(path)
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = _unescape_mount(fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the last of equal mount points is the visible one
            best, fstype = len(mount), right.split()[0]
    return fstype


def guess_kind(filesystem: str) -> Kind:
    """The tier kind a file system type suggests (a local one where it names neither of the others)."""
    if filesystem in PARALLEL_FS:
        return "parallel-fs"
    if filesystem in OBJECT_FS:
        return "object-store"
    return "local-nvme"


def resolve_target(path_or_url: str) -> Path:
    """The folder to measure in, resolved; refused in one line where measuring there is unsafe.

    Raises:
        ConfigError: a URL other than file://, a missing path, a file, a pseudo file system, or a folder
            this process cannot write.
    """
    text = path_or_url.strip()
    if not text or "\x00" in text:
        raise ConfigError("storage-bench needs a folder to measure in")
    parsed = urlparse(text)
    if parsed.scheme and len(parsed.scheme) > 1:  # a one-letter "scheme" is a Windows drive, not a URL
        if parsed.scheme != "file":
            raise ConfigError(
                f"storage-bench measures a mounted folder, not {parsed.scheme}:// URLs: mount the store "
                "(e.g. mountpoint-s3, gcsfuse) and give the mount's folder"
            )
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URL {text!r} names host {parsed.netloc!r}: only this host's files")
        text = unquote(parsed.path)
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    resolved = path.resolve()
    if not resolved.is_dir():
        raise ConfigError(f"{resolved} is not a folder: give the folder of the tier to measure in")
    for root in PSEUDO_ROOTS:
        if resolved == root or root in resolved.parents:
            raise ConfigError(f"{resolved} is under {root}, a kernel file system, not storage: refused")
    fstype = filesystem_of(resolved)
    if fstype in PSEUDO_FS:
        raise ConfigError(f"{resolved} is on {fstype}, a kernel file system, not storage: refused")
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise ConfigError(f"{resolved} is not writable by this user")
    return resolved


@dataclass(frozen=True)
class BenchConfig:
    """How much to write and how long to take (bounded by MIN/MAX_SIZE, MIN/MAX_BLOCK, MAX_SECONDS)."""

    size_bytes: int = 512 << 20
    block_bytes: int = 4 << 20
    max_seconds: float = 60.0
    random_reads: int = MAX_RANDOM_READS  # at most this many random reads (fewer when their time is up)
    fsyncs: int = MAX_FSYNCS

    def check(self) -> None:
        """Raises ConfigError naming the bound a setting breaks."""
        if not MIN_SIZE <= self.size_bytes <= MAX_SIZE:
            raise ConfigError(f"--size must be between {MIN_SIZE >> 20} MiB and {MAX_SIZE >> 30} GiB")
        if not MIN_BLOCK <= self.block_bytes <= MAX_BLOCK or self.block_bytes % 4096:
            raise ConfigError(f"--block must be a multiple of 4 KiB between 4 KiB and {MAX_BLOCK >> 20} MiB")
        if self.block_bytes > self.size_bytes:
            raise ConfigError("--block must not be larger than --size")
        if not 1.0 <= self.max_seconds <= MAX_SECONDS:
            raise ConfigError(f"--max-seconds must be between 1 and {MAX_SECONDS:.0f}")
        if not (1 <= self.random_reads <= MAX_RANDOM_READS and 1 <= self.fsyncs <= MAX_FSYNCS):
            raise ConfigError(
                f"at most {MAX_RANDOM_READS} random reads and {MAX_FSYNCS} fsyncs, at least one"
            )


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """While measuring, SIGTERM ends the run through its cleanup (SystemExit 143) instead of killing it
    with its files left behind; Ctrl-C (KeyboardInterrupt) already does. Main thread only (a signal
    handler cannot be set elsewhere); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        sys.stderr.write("storage-bench stopped by SIGTERM: its folder is removed, nothing was measured\n")
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drop_cache(fd: int) -> bool:
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_OPEN_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def run_storage_bench(
    folder: Path, cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter
) -> StorageMeasurement:
    """Measure the tier holding ``folder`` (already checked by :func:`resolve_target`); always cleans up.

    ``clock`` times the phases (a test passes one that runs fast to see the budget cut phases short).

    Raises:
        ConfigError: too little free space, or an I/O error (the message names the file and the phase).
    """
    cfg.check()
    now = clock
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if free < cfg.size_bytes + FREE_MARGIN:
        raise ConfigError(
            f"{folder} has {free / 2**20:.0f} MiB free: --size {cfg.size_bytes / 2**20:.0f} MiB needs "
            f"{(cfg.size_bytes + FREE_MARGIN) / 2**20:.0f} MiB (the file plus a 64 MiB margin)"
        )
    fstype = filesystem_of(folder)
    with _terminate_cleanly():
        return _measure(folder, cfg, now, fstype)


def _measure(folder: Path, cfg: BenchConfig, now: Callable[[], float], fstype: str) -> StorageMeasurement:
    started = now()
    budget = {phase: share * cfg.max_seconds for phase, share in PHASE_SHARE.items()}
    truncated: list[str] = []
    work = Path(tempfile.mkdtemp(prefix=".gpuyard-storage-bench-", dir=folder))
    data_path, sync_path = work / "data", work / "fsync"
    phase = "write"
    try:
        block = os.urandom(cfg.block_bytes)
        # Sequential write, fsync included.
        fd = os.open(data_path, os.O_WRONLY | _OPEN_NEW, 0o600)
        try:
            t0 = now()
            written = 0
            while written < cfg.size_bytes:
                n = os.write(fd, block[: min(cfg.block_bytes, cfg.size_bytes - written)])
                written += n
                if now() - t0 > budget["write"] and written < cfg.size_bytes:
                    truncated.append("write")
                    break
            os.fsync(fd)
            write_s = now() - t0
            dropped = _drop_cache(fd)
        finally:
            os.close(fd)
        # Sequential read.
        phase = "read"
        buf = bytearray(cfg.block_bytes)
        view = memoryview(buf)
        fd = os.open(data_path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            _drop_cache(fd)
            t0 = now()
            read = 0
            while read < written:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                read += n
                if now() - t0 > budget["read"] and read < written:
                    truncated.append("read")
                    break
            read_s = now() - t0
            # Random 4 KiB reads at aligned offsets.
            phase = "random_read"
            dropped = _drop_cache(fd) and dropped
            rng = random.Random(0x5EED)
            slots = max(1, written // RANDOM_READ_BYTES)
            latencies: list[float] = []
            t0 = now()
            while len(latencies) < cfg.random_reads:
                offset = rng.randrange(slots) * RANDOM_READ_BYTES
                t = now()
                os.pread(fd, RANDOM_READ_BYTES, offset)
                latencies.append(now() - t)
                if now() - t0 > budget["random_read"]:
                    break
            random_s = now() - t0
        finally:
            os.close(fd)
        # fsync of a small write.
        phase = "fsync"
        small = block[:4096]
        fd = os.open(sync_path, os.O_WRONLY | _OPEN_NEW, 0o600)
        try:
            syncs: list[float] = []
            t0 = now()
            while len(syncs) < cfg.fsyncs:
                t = now()
                os.pwrite(fd, small, 0)
                os.fsync(fd)
                syncs.append(now() - t)
                if now() - t0 > budget["fsync"]:
                    break
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"storage-bench {phase} in {work} failed: {exc.strerror or exc}") from None
    finally:
        _remove(work, (data_path, sync_path))
    return StorageMeasurement(
        path=str(folder),
        filesystem=fstype,
        host=socket.gethostname(),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        file_bytes=written,
        block_bytes=cfg.block_bytes,
        seq_write_GBps=written / max(write_s, 1e-9) / 1e9,
        seq_read_GBps=max(read, 1) / max(read_s, 1e-9) / 1e9,
        random_reads=len(latencies),
        random_read_iops=len(latencies) / max(random_s, 1e-9),
        random_read_p50_ms=statistics.median(latencies) * 1e3,
        random_read_p99_ms=_pct(latencies, 0.99) * 1e3,
        fsyncs=len(syncs),
        fsync_p50_ms=statistics.median(syncs) * 1e3,
        fsync_p99_ms=_pct(syncs, 0.99) * 1e3,
        memory_backed=fstype in MEMORY_FS,
        cache_dropped=dropped,
        truncated=truncated,
        seconds=now() - started,
    )


def _remove(work: Path, files: tuple[Path, ...]) -> None:
    """Remove the bench's own files and folder; a leftover is named in one line rather than hidden."""
    for f in files:
        with contextlib.suppress(OSError):  # the folder's removal below names what is left
            f.unlink(missing_ok=True)
    try:
        work.rmdir()
    except FileNotFoundError:
        return
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"storage-bench could not remove its folder {work}: {why}") from None
