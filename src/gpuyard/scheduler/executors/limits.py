"""What a job may use of the machine: memory, CPU cores, processes, open files and log bytes.

`gpuyard server` enforces a job's declared resources (``resources.memory_gb`` and ``cpus``) and its
own defaults (``--job-memory-gb``, ``--job-pids``, ``--job-nofile``, ``--job-log-mb``) with, in this
order of preference, detected once at start:

- **cgroup v2** where the server's own cgroup has the memory and pids controllers and is writable:
  one cgroup per job attempt under ``<server's cgroup>/gpuyard-jobs`` with ``memory.max`` (and
  ``memory.swap.max`` 0), ``pids.max`` and ``cpu.max``; an OOM kill is read from ``memory.events``.
- **cgroup v1** where the memory, pids and cpu hierarchies are mounted and writable: one cgroup per
  job attempt in each, under the server's own cgroup there (``memory.limit_in_bytes`` and
  ``memory.memsw.limit_in_bytes``, ``pids.max``, ``cpu.cfs_quota_us``); an OOM kill is read from
  ``memory.oom_control`` (``oom_kill``), else ``memory.failcnt`` with a SIGKILL.
- **setrlimit** for what no cgroup covers: ``RLIMIT_DATA`` for memory (private writable mappings:
  heap and anonymous memory, per process), ``RLIMIT_NPROC`` for processes (counted per Unix user, so
  it is set to the user's processes at launch plus the job's allowance). ``RLIMIT_NOFILE`` is always
  set (a per-process limit; no cgroup counts files).

The cgroup is created by the server (mkdir: never an existing one), entered by the shim just before
it starts the job's command (the command is born inside it), emptied (every process killed) when the
command ends and removed by the server when it collects the attempt.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuyard import privileged
from gpuyard.errors import ConfigError
from gpuyard.scheduler.spec import JobSpec

log = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20
CPU_PERIOD_US = 100_000  # the kernel's default CFS period
DEFAULT_PIDS = 4096
DEFAULT_NOFILE = 65536
DEFAULT_LOG_MB = 100.0
CONTROLLERS = ("memory", "pids", "cpu")


def format_bytes(n: int) -> str:
    """``1.0 GiB`` from 1 GiB up, ``256 MiB`` below (the unit a limit was most likely given in)."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n} bytes"


def cpu_max(cpus: float, period_us: int = CPU_PERIOD_US) -> tuple[int, int]:
    """The CFS quota and period (microseconds) that let a cgroup use ``cpus`` cores' worth of time."""
    if cpus <= 0:
        raise ValueError(f"cpus must be > 0, got {cpus}")
    return max(1000, round(cpus * period_us)), period_us  # the kernel refuses quotas under 1 ms


@dataclass(frozen=True)
class JobLimits:
    """The limits of one job attempt (None: not limited).

    Attributes:
        memory_bytes: memory of the whole job (all its processes).
        cpus: cores' worth of CPU time per period (fractions allowed).
        pids: processes and threads of the whole job.
        nofile: open files of each process.
        log_bytes: bytes of output the attempt may add to its log.
    """

    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    nofile: int | None = None
    log_bytes: int | None = None

    def oom_reason(self) -> str:
        """The reason of a job killed for its memory: ``out of memory: limit 1.0 GiB``."""
        limit = format_bytes(self.memory_bytes) if self.memory_bytes else "the machine's"
        return f"out of memory: limit {limit}"


@dataclass(frozen=True)
class LimitDefaults:
    """The server's limits for what a job does not declare (``gpuyard server --job-*``).

    Attributes:
        memory_gb: memory of a job without ``resources.memory_gb`` (None: not limited).
        pids: processes and threads of a job.
        nofile: open files of each of a job's processes.
        log_mb: MiB of output each attempt of a job may write to its log (None: not capped).
    """

    memory_gb: float | None = None
    pids: int | None = DEFAULT_PIDS
    nofile: int | None = DEFAULT_NOFILE
    log_mb: float | None = DEFAULT_LOG_MB

    def __post_init__(self) -> None:
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ConfigError(
                f"--job-memory-gb {self.memory_gb:g}: must be above 0 (leave it out: no default)"
            )
        if self.pids is not None and self.pids < 16:
            raise ConfigError(f"--job-pids {self.pids}: at least 16 (0: not limited)")
        if self.nofile is not None and self.nofile < 64:
            raise ConfigError(f"--job-nofile {self.nofile}: at least 64 (0: not limited)")
        if self.log_mb is not None and not self.log_mb > 0:
            raise ConfigError(f"--job-log-mb {self.log_mb:g}: must be above 0 (0: not capped)")

    def for_spec(self, spec: JobSpec) -> JobLimits:
        """The limits of ``spec``: its declared memory and cores, else these defaults.

        Cores are limited for a CPU-only job (placed on ``cpus`` slots) and for a GPU job that asks for
        more than one; a GPU job at the default ``cpus: 1`` (a slot count for placement, not what its
        data loaders need; a stored spec cannot tell it from an explicit 1) keeps every core.
        """
        res = spec.resources
        memory_gb = res.memory_gb if res.memory_gb is not None else self.memory_gb
        gpu_job = bool(res.gpus or res.gpu_fraction or res.gpu_memory_gb or res.mig)
        cpus: float | None = float(res.cpus) if not gpu_job or res.cpus > 1 else None
        if cpus is not None and cpus >= (os.cpu_count() or 1):
            cpus = None  # the whole machine: nothing to limit
        return JobLimits(
            memory_bytes=int(memory_gb * GIB) if memory_gb else None,
            cpus=cpus,
            pids=self.pids,
            nofile=self.nofile,
            log_bytes=int(self.log_mb * MIB) if self.log_mb else None,
        )

    def describe(self) -> str:
        """``memory 1.0 GiB by default, 4096 processes, 65536 open files, log 100 MiB per attempt``."""
        mem = f"{format_bytes(int(self.memory_gb * GIB))} by default" if self.memory_gb else "as declared"
        parts = [f"memory {mem}", "cores as declared"]
        parts.append(f"{self.pids} processes" if self.pids else "processes unlimited")
        parts.append(f"{self.nofile} open files" if self.nofile else "open files unlimited")
        parts.append(f"log {self.log_mb:g} MiB per attempt" if self.log_mb else "log not capped")
        return ", ".join(parts)


# --- Where the server's cgroups are ----------------------------------------------------------------


def parse_mountinfo(text: str) -> list[tuple[str, str, str, set[str]]]:
    """The cgroup mounts of a ``/proc/self/mountinfo`` text: (mount point, root, fstype, options)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((point, fields[3], tail[0], set(tail[2].split(","))))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup``: controller (``""`` for the v2 hierarchy, ``name=x`` kept) -> path."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(",") if parts[1] else [""]:
            out[ctrl] = parts[2]
    return out


def _under(point: str, root: str, path: str) -> Path:
    """The folder of cgroup ``path`` in a hierarchy mounted at ``point`` whose mount root is ``root``."""
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(point) / rel.lstrip("/")


@dataclass
class Cgroups:
    """The cgroup hierarchies job cgroups are created in (version 0: none usable, setrlimit only).

    Attributes:
        version: 2, 1 or 0.
        bases: controller -> the folder job cgroups are created in (v2: one folder for all).
        home: controller -> the server's own cgroup folder (the shim goes back there once the job's
            command has started in its cgroup).
        why: why no cgroup (or not every controller) is used, for the startup line.
    """

    version: int
    bases: dict[str, Path] = field(default_factory=dict)
    home: dict[str, Path] = field(default_factory=dict)
    why: str = ""

    @property
    def controllers(self) -> set[str]:
        """The controllers limits are applied with."""
        return set(self.bases) if self.version == 1 else ({*CONTROLLERS} if self.version == 2 else set())

    def describe(self) -> str:
        """One phrase for the startup line: which mechanism limits what."""
        if self.version == 2:
            return f"cgroup v2 under {self.bases['']} (memory, pids, cpu) + setrlimit (open files)"
        rl = ["open files"]
        if "memory" not in self.controllers:
            rl.insert(0, "memory as RLIMIT_DATA per process")
        if "pids" not in self.controllers:
            rl.insert(0, "processes as RLIMIT_NPROC per Unix user")
        head = f"cgroup v1 ({', '.join(sorted(self.bases))})" if self.version == 1 else "no cgroup"
        cores = "" if "cpu" in self.controllers else "; CPU cores NOT limited"
        return f"{head} + setrlimit ({', '.join(rl)}){cores}" + (f" ({self.why})" if self.why else "")

    def handle(self, name: str) -> dict[str, Any]:
        """Where the cgroup(s) of one attempt called ``name`` will be (nothing is created): ``dirs`` (to
        empty and remove), ``procs`` (the ``cgroup.procs`` files the shim joins), ``leave`` (the server's
        own, where the shim returns), ``memory`` (the file with the ``oom_kill`` count), ``version``.
        Empty without cgroups."""
        if self.version == 2:
            path = self.bases[""] / name
            return {
                "version": 2,
                "dirs": [str(path)],
                "procs": [str(path / "cgroup.procs")],
                "leave": [str(self.home[""] / "cgroup.procs")],
                "memory": str(path / "memory.events"),
                "kill": str(path / "cgroup.kill"),
            }
        if self.version == 1:
            ctrls = sorted(self.bases)
            mem = self.bases.get("memory")
            return {
                "version": 1,
                "controllers": ctrls,
                "dirs": [str(self.bases[c] / name) for c in ctrls],
                "procs": [str(self.bases[c] / name / "cgroup.procs") for c in ctrls],
                "leave": [str(self.home[c] / "cgroup.procs") for c in ctrls],
                "memory": str(mem / name / "memory.oom_control") if mem else "",
                "failcnt": str(mem / name / "memory.failcnt") if mem else "",
            }
        return {}


def create(handle: dict[str, Any], limits: JobLimits) -> None:
    """Create the cgroup(s) of ``handle`` (:meth:`Cgroups.handle`) with ``limits`` written.

    Raises:
        OSError: a cgroup exists already (never reused), or could not be created or limited; what was
            made is removed.
    """
    made: list[str] = []
    try:
        if handle.get("version") == 2:
            path = Path(handle["dirs"][0])
            path.mkdir(mode=0o755)
            made.append(str(path))
            _write_v2(path, limits)
        elif handle.get("version") == 1:
            for ctrl, folder in zip(handle["controllers"], handle["dirs"], strict=True):
                Path(folder).mkdir(mode=0o755)
                made.append(folder)
                _write_v1(ctrl, Path(folder), limits)
    except OSError:
        remove({"dirs": made})
        raise


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _write_v2(path: Path, limits: JobLimits) -> None:
    if limits.memory_bytes:
        _write(path / "memory.max", str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to escape to
            _write(path / "memory.swap.max", "0")
    if limits.pids:
        _write(path / "pids.max", str(limits.pids))
    if limits.cpus:
        quota, period = cpu_max(limits.cpus)
        _write(path / "cpu.max", f"{quota} {period}")


def _write_v1(ctrl: str, path: Path, limits: JobLimits) -> None:
    if ctrl == "memory" and limits.memory_bytes:
        _write(path / "memory.limit_in_bytes", str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # swap accounting off: swap cannot be used
            _write(path / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    elif ctrl == "pids" and limits.pids:
        _write(path / "pids.max", str(limits.pids))
    elif ctrl == "cpu" and limits.cpus:
        quota, period = cpu_max(limits.cpus)
        _write(path / "cpu.cfs_period_us", str(period))
        _write(path / "cpu.cfs_quota_us", str(quota))


def detect(mountinfo: str | None = None, proc_cgroup: str | None = None) -> Cgroups:
    """The usable cgroup hierarchies of this server: v2 if it has memory and pids, else v1, else none.

    Usable means the server can create a child of its own cgroup there (tried, then removed).
    """
    try:
        mounts = parse_mountinfo(
            mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
        )
        mine = parse_proc_cgroup(
            proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        )
    except OSError as exc:
        return Cgroups(0, why=f"cannot read the cgroup mounts: {exc.strerror}")
    reasons: list[str] = []
    v2 = next((m for m in mounts if m[2] == "cgroup2"), None)
    if v2 is not None and "" in mine:
        found = _setup_v2(_under(v2[0], v2[1], mine[""]), reasons)
        if found is not None:
            return found
    bases: dict[str, Path] = {}
    home: dict[str, Path] = {}
    for ctrl in CONTROLLERS:
        mount = next((m for m in mounts if m[2] == "cgroup" and ctrl in m[3]), None)
        if mount is None or ctrl not in mine:
            continue
        own = _under(mount[0], mount[1], mine[ctrl])
        if _can_create(own):
            bases[ctrl], home[ctrl] = own, own
        else:
            reasons.append(f"cgroup v1 {ctrl} at {own} not writable")
    if bases:
        return Cgroups(1, bases, home, why="; ".join(reasons))
    if not reasons:
        reasons.append("no cgroup hierarchy with memory or pids mounted")
    return Cgroups(0, why="; ".join(reasons))


def _can_create(folder: Path) -> bool:
    probe = folder / f"gpuyard-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def _setup_v2(own: Path, reasons: list[str]) -> Cgroups | None:
    """Job cgroups under ``own/gpuyard-jobs`` with memory, pids and cpu delegated to them.

    A v2 cgroup that hands controllers to its children holds no processes itself: when the server's
    cgroup holds processes (its own), they are moved into a leaf ``own/gpuyard-server`` first, as a
    service with a delegated cgroup does.
    """
    try:
        available = set((own / "cgroup.controllers").read_text().split())
    except OSError as exc:
        reasons.append(f"cgroup v2 at {own}: {exc.strerror}")
        return None
    if not {"memory", "pids"} <= available or not os.access(own, os.W_OK):
        reasons.append(f"cgroup v2 at {own} lacks memory/pids or is not writable")
        return None
    wanted = " ".join(f"+{c}" for c in CONTROLLERS if c in available)
    home = own
    try:
        try:
            _write(own / "cgroup.subtree_control", wanted)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            home = own / "gpuyard-server"
            home.mkdir(exist_ok=True)
            for pid in (own / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    _write(home / "cgroup.procs", pid)
            _write(own / "cgroup.subtree_control", wanted)
        jobs = own / "gpuyard-jobs"
        jobs.mkdir(exist_ok=True)
        st = jobs.lstat()
        if st.st_uid != os.geteuid():
            raise ConfigError(f"cgroup {jobs} exists and is not the server's: remove it")
        _write(jobs / "cgroup.subtree_control", wanted)
    except OSError as exc:
        reasons.append(f"cgroup v2 at {own}: cannot delegate controllers ({exc.strerror})")
        return None
    return Cgroups(2, {"": jobs}, {"": home})


# --- At the end of an attempt -----------------------------------------------------------------------


def oom_kills(handle: dict[str, Any]) -> int:
    """OOM kills in the attempt's memory cgroup (``oom_kill`` of memory.events / memory.oom_control);
    where the kernel has no such count, 1 if the memory limit was ever hit (``memory.failcnt``)."""
    path = handle.get("memory")
    if not path:
        return 0
    try:
        text = Path(path).read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    with contextlib.suppress(OSError, ValueError, KeyError):
        return 1 if int(Path(handle["failcnt"]).read_text()) > 0 else 0
    return 0


def kill_all(handle: dict[str, Any], timeout_s: float = 5.0) -> None:
    """SIGKILL every process left in the attempt's cgroup (until it is empty, or ``timeout_s``)."""
    kill_file = handle.get("kill")
    if kill_file and os.path.exists(kill_file):
        with contextlib.suppress(OSError):
            _write(Path(kill_file), "1")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids: set[int] = set()
        for procs in handle.get("procs", []):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in Path(procs).read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    log.warning("processes of cgroup %s still alive after SIGKILL", handle.get("dirs"))


def remove(handle: dict[str, Any]) -> None:
    """Remove the attempt's cgroup folders (killing what is left in them first)."""
    dirs = [d for d in handle.get("dirs", []) if os.path.isdir(d)]
    if not dirs:
        return
    if handle.get("procs"):
        kill_all(handle)
    for d in dirs:
        for _ in range(50):  # the kernel frees a cgroup a moment after its last process is reaped
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", d, exc.strerror)
                    break
                time.sleep(0.02)


def rlimits(limits: JobLimits, cgroups: Cgroups, uid: int | None) -> dict[str, int]:
    """The setrlimit values (resource name -> soft and hard limit) of a job's command.

    ``NOFILE`` always; ``DATA`` (memory) where no memory cgroup limits the job; ``NPROC`` where no pids
    cgroup does, as the processes ``uid`` (the job's real user) already has plus the job's allowance,
    since the kernel counts it per user. Root's processes are not counted by the kernel: no NPROC.
    """
    out: dict[str, int] = {}
    if limits.nofile:
        out["NOFILE"] = limits.nofile
    if limits.memory_bytes and "memory" not in cgroups.controllers:
        out["DATA"] = limits.memory_bytes
    if limits.pids and "pids" not in cgroups.controllers and uid not in (None, 0):
        out["NPROC"] = _user_tasks(uid) + limits.pids
    return out


def _user_tasks(uid: int | None) -> int:
    """Processes and threads whose real user is ``uid`` now (what RLIMIT_NPROC counts)."""
    import psutil

    count = 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if proc.info["uids"].real == uid:
                count += int(proc.info["num_threads"] or 1)
    return count


# --- All of it, detected once at the server's start -----------------------------------------------


@dataclass(frozen=True)
class Confinement:
    """What `gpuyard server` confines its local jobs with.

    Attributes:
        defaults: the limits of what a job does not declare.
        cgroups: the hierarchies job cgroups are made in (version 0: setrlimit only).
        namespace: ``{"shm": True, "hidepid": True}`` when each job gets a mount namespace with its own
            /dev/shm and a /proc hiding other users' processes; empty when the machine does not allow it.
        namespace_why: why not, when it does not.
    """

    defaults: LimitDefaults
    cgroups: Cgroups
    namespace: dict[str, bool] = field(default_factory=dict)
    namespace_why: str = ""

    def describe(self) -> str:
        """The startup line's part: limits, by what, and the private mounts (or why none)."""
        ns = (
            "private /dev/shm and /proc hidepid=invisible per job (mount namespace)"
            if self.namespace
            else f"NO private /dev/shm or /proc hidepid ({self.namespace_why})"
        )
        return f"limits: {self.defaults.describe()}; by {self.cgroups.describe()}; {ns}"


def setup_confinement(defaults: LimitDefaults) -> Confinement:
    """Detect what this machine allows (cgroups, a mount namespace per job) for ``defaults``."""
    cgroups = detect()
    namespace: dict[str, bool] = {}
    why = ""
    if os.geteuid() != 0:
        why = "the server is not root"
    else:
        import subprocess
        import sys

        shim = Path(__file__).with_name("shim.py")
        try:
            probe = subprocess.run(
                [sys.executable, "-I", "-S", str(shim), "--probe-namespace"],
                env=privileged.environment(),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"cannot probe: {exc}"
        else:
            if probe.returncode == 0:
                namespace = {"shm": True, "hidepid": True}
            else:
                why = (probe.stdout.strip() or probe.stderr.strip() or "mount namespace refused")[:200]
    return Confinement(defaults, cgroups, namespace, why)
