"""Each team's share of GPUYARD_HOME's disk, and the reserve `gpuyard server` keeps there for itself.

A job's log is written by its shim (the server's user) into the job's folder under GPUYARD_HOME;
without a bound, one team's jobs fill the disk and then every team's submissions are refused (507).
So the server keeps, per team, what its jobs' folders hold (logs, exit and job files; with jobs run as
the server's own user, also their working directories under GPUYARD_HOME/work), and gives each running
attempt of the team an allowance: the log's size now plus an equal part of what the team has left of
its quota (``--team-disk-gb``). The shim reads that allowance from a small file the server rewrites
(``attempt-N.exit.budget``) and, before every write, also keeps ``--disk-reserve-mb`` free on the
log's disk. A log past either is cut with a line saying why, and the server records an event on the
job as soon as it sees the cut (the job is not killed). The log cap of an attempt is thus the least of
``--job-log-mb``, the team's remaining quota (shared among its running attempts) and the free space
above the reserve.

Efficiency: a finished job's folder is measured once (after it ends); the running jobs' folders are
measured every ``REFRESH_S`` in the scheduling loop (a few files each), their logs' sizes read with one
``stat`` when an allowance is computed; the list of job folders is read again every ``RESCAN_S``, so
folders an operator removed stop counting. Nothing walks the whole tree on a write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from gpuyard.errors import ConfigError
from gpuyard.scheduler.executors.limits import format_bytes
from gpuyard.store.tables.jobs import JobEventRow, JobRow

log = logging.getLogger(__name__)

MIB, GIB = 2**20, 2**30
# Submissions are refused below 16 MiB free (service.MIN_FREE_TO_SUBMIT): the reserve stays above it.
MIN_RESERVE_BYTES = 24 * MIB
DEFAULT_TEAM_FRACTION = 0.25  # of the disk of GPUYARD_HOME, without --team-disk-gb
REFRESH_S = 2.0
RESCAN_S = 60.0
# Left out of each attempt's allowance: its job, pid, exit and allowance files and the cut's own lines,
# written past the allowance (a few KiB), so that the team's files together stay within its quota.
ATTEMPT_FILES_BYTES = 16 << 10
# The most one write of the shim adds to a log (it copies the job's output in reads of this size,
# gpuyard.scheduler.executors.shim._copy): a write it decided before it saw a smaller allowance.
SHIM_WRITE_BYTES = 1 << 16
MAX_ENTRIES = 100_000  # files counted per job folder per measure (a folder of millions is "at least")
ACTIVE = ("scheduled", "running")


@dataclass(frozen=True)
class DiskPolicy:
    """The disk shares of one server.

    Attributes:
        team_bytes: what one team's job folders may hold under GPUYARD_HOME (None: no team quota).
        reserve_bytes: free space no job's log takes on the disk of GPUYARD_HOME.
    """

    team_bytes: int | None
    reserve_bytes: int

    def describe(self) -> str:
        """One phrase for the startup line."""
        team = (
            f"{format_bytes(self.team_bytes)} per team (--team-disk-gb)"
            if self.team_bytes
            else "no team quota"
        )
        return f"job files under GPUYARD_HOME: {team}, {format_bytes(self.reserve_bytes)} kept free"


def resolve_policy(home: Path, team_gb: float | None, reserve_mb: float | None) -> DiskPolicy:
    """The shares for ``home``'s disk: ``team_gb`` (None: a quarter of the disk; 0: none) and
    ``reserve_mb`` (None: 5% of the disk, between 24 MiB and 1 GiB).

    Raises:
        ConfigError: a reserve under 24 MiB (submissions need 16 MiB free), or a negative value.
    """
    st = os.statvfs(home)
    size = st.f_blocks * st.f_frsize
    if reserve_mb is None:
        reserve = max(MIN_RESERVE_BYTES, min(GIB, size // 20))
    else:
        reserve = int(reserve_mb * MIB)
        if reserve < MIN_RESERVE_BYTES:
            raise ConfigError(
                f"--disk-reserve-mb {reserve_mb:g}: at least {MIN_RESERVE_BYTES // MIB} (new jobs are "
                "refused below 16 MiB free, and logs must never take the disk there)"
            )
    if team_gb is not None and team_gb < 0:
        raise ConfigError(f"--team-disk-gb {team_gb:g}: must be >= 0 (0: no team quota)")
    team = int(size * DEFAULT_TEAM_FRACTION) if team_gb is None else int(team_gb * GIB)
    return DiskPolicy(team_bytes=team or None, reserve_bytes=reserve)


def folder_bytes(path: Path, limit: int = MAX_ENTRIES) -> int:
    """The disk space under ``path`` (allocated blocks), at most ``limit`` entries counted.

    Each folder is opened relative to its parent's descriptor with ``O_NOFOLLOW``: a job that swaps a
    folder of its own for a link while it is counted never sends the count elsewhere.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(path, flags)
    except OSError:
        return 0
    total, seen = 0, 0
    pending = [top]
    try:
        while pending:
            fd = pending.pop()
            try:
                if seen >= limit:
                    continue
                with os.scandir(fd) as entries:
                    for entry in entries:
                        seen += 1
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        total += st.st_blocks * 512
                        if stat.S_ISDIR(st.st_mode) and seen < limit:
                            with contextlib.suppress(OSError):
                                pending.append(os.open(entry.name, flags, dir_fd=fd))
                        if seen >= limit:
                            break
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        for fd in pending:
            os.close(fd)
    return total


class DiskShares:
    """Per-team use of the job folders under ``jobs_dir`` and the log allowances of running attempts.

    A team's use now is what its finished jobs' folders held when last measured, plus for each of its
    active jobs what its folder holds besides the log (measured every ``REFRESH_S``) and its log's
    size now (one ``stat``). Each attempt with an allowance gets ``its log's size + (quota - use) / n``
    for the ``n`` such attempts of the team, rewritten for all of them whenever one starts and at every
    refresh: their allowances never add up to more than the quota (the shim re-reads its file as soon
    as it changes).

    Args:
        jobs_dir: one folder per job (GPUYARD_HOME/jobs).
        policy: the team quota and the reserve.
        work_dir: the jobs' working directories when they lie under GPUYARD_HOME (their user's files
            count too), else None.
    """

    def __init__(self, jobs_dir: Path, policy: DiskPolicy, work_dir: Path | None = None) -> None:
        self.jobs_dir, self.policy, self.work_dir = Path(jobs_dir), policy, work_dir
        self.finished: dict[int, tuple[str, int]] = {}  # job -> (team, bytes), measured after its end
        self.active: dict[int, tuple[str, int, str]] = {}  # job -> (team, bytes besides its log, log)
        self.budgets: dict[int, str] = {}  # active job -> its attempt's allowance file
        self._reported: set[str] = set()  # cut files already turned into events
        self._refreshed = float("-inf")
        self._scanned = float("-inf")
        self._failed_at = float("-inf")

    def describe(self) -> str:
        """The startup line's phrase."""
        return self.policy.describe()

    def used(self, team: str) -> int:
        """Bytes ``team``'s job folders hold now (finished ones as last measured)."""
        total = sum(size for t, size in self.finished.values() if t == team)
        for t, besides, log_path in self.active.values():
            if t == team:
                total += besides + _size_of(log_path)
        return total

    # -- at launch ---------------------------------------------------------------------------------

    def grant(self, job_id: int, extra: dict[str, Any], log_path: str, team: str) -> None:
        """Give a new attempt its allowance: ``extra`` (the launch plan's, which becomes the handle)
        gets the allowance file and the reserve the shim reads; the team's other attempts' allowances
        shrink to make room for it."""
        exit_file = extra.get("exit_file")
        if not exit_file:
            return  # not the local executor's shim: nothing reads an allowance
        extra["disk_reserve"] = self.policy.reserve_bytes
        if self.policy.team_bytes is None:
            return
        extra["log_budget"] = f"{exit_file}.budget"
        self.active[job_id] = (team, self._besides_log(job_id, log_path), log_path)
        self.budgets[job_id] = extra["log_budget"]
        self._allot(team)

    # -- in the scheduling loop --------------------------------------------------------------------

    def maybe_refresh(self, store: Any) -> None:
        """:meth:`refresh` when ``REFRESH_S`` have passed; a failure is logged (at most once a minute)
        and never stops the scheduling loop."""
        now = time.monotonic()
        if now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        try:
            self.refresh(store)
        except Exception as exc:  # a full disk, a database outage: the next pass tries again
            if now - self._failed_at >= 60.0:
                self._failed_at = now
                log.warning("disk shares not refreshed: %s", exc)

    def refresh(self, store: Any) -> None:
        """Measure the active jobs' folders (and new finished ones), rewrite the allowances of the
        running attempts, and record an event for each log cut since the last pass."""
        with store.session() as s:
            rows = s.execute(
                select(JobRow.id, JobRow.team, JobRow.state, JobRow.handle, JobRow.log_path).where(
                    JobRow.state.in_(ACTIVE)
                )
            ).all()
            ids = {r.id for r in rows}
            for gone in set(self.active) - ids:  # ended since the last pass: measured once more
                team = self.active.pop(gone)[0]
                self.budgets.pop(gone, None)
                self.finished[gone] = (team, self._measure(gone))
            if time.monotonic() - self._scanned >= RESCAN_S:
                self._rescan(s, ids)
            for r in rows:
                handle = r.handle or {}
                log_path = str(handle.get("log") or r.log_path or "")
                self.active[r.id] = (r.team, self._besides_log(r.id, log_path), log_path)
                if handle.get("log_budget"):
                    self.budgets[r.id] = str(handle["log_budget"])
                self._report_cut(s, r.id, r.state, handle)
        for team in {self.active[j][0] for j in self.budgets if j in self.active}:
            self._allot(team)

    def _allot(self, team: str) -> None:
        """Rewrite the allowance of each attempt of ``team``: its log now plus an equal part of what
        the team has left.

        The shim checks its allowance before each write, but an attempt writes on under its old
        allowance until it sees the new one: measured at 8 MiB with 16 allowed, it may be at 15 by the
        time a smaller allowance lands. So the allowances that shrink are written first, the logs
        measured again (plus one write the shim may have decided before it looked), and the attempts
        whose allowance grows (a new one) share only what those left: the team's files never pass its
        quota, however fast a job writes.
        """
        quota = self.policy.team_bytes
        if quota is None:
            return
        mine = [
            (j, path) for j, path in self.budgets.items() if j in self.active and self.active[j][0] == team
        ]
        if not mine:
            return
        logs = {j: self.active[j][2] for j, _ in mine}
        sizes = {j: _size_of(logs[j]) for j in logs}
        used = self.used(team)
        files = ATTEMPT_FILES_BYTES * len(mine)
        part = max(0, quota - used - files) // len(mine)
        running = f"{len(mine)} attempts" if len(mine) > 1 else "1 attempt"
        why = (
            f"its share of team {team}'s disk quota, {format_bytes(quota)} under GPUYARD_HOME (gpuyard "
            f"server --team-disk-gb): the team had used {format_bytes(used)}, {running} sharing the rest"
        )
        shrinking = [(j, path) for j, path in mine if _read_budget(path) > sizes[j] + part]
        growing = [(j, path) for j, path in mine if (j, path) not in shrinking]
        held = 0  # what the shrunk attempts' logs may hold now
        for job_id, path in shrinking:
            _write_budget(path, sizes[job_id] + part, why)
        for job_id, _ in shrinking:
            held += max(sizes[job_id] + part, _size_of(logs[job_id]) + SHIM_WRITE_BYTES)
        if not growing:
            return
        others = used - sum(sizes.values())  # finished jobs, files besides the logs
        left = quota - others - files - held - sum(sizes[j] for j, _ in growing)
        share = min(part, max(0, left) // len(growing))
        for job_id, path in growing:
            _write_budget(path, sizes[job_id] + share, why)

    def _rescan(self, s: Any, active: set[int]) -> None:
        """List the job folders: count new finished ones (their teams read in one query), drop removed."""
        self._scanned = time.monotonic()
        try:
            names = {int(e.name) for e in os.scandir(self.jobs_dir) if e.name.isdigit()}
        except OSError:
            return
        for gone in set(self.finished) - names:
            del self.finished[gone]
        new = sorted(names - set(self.finished) - active)
        for start in range(0, len(new), 500):
            chunk = new[start : start + 500]
            teams = dict(s.execute(select(JobRow.id, JobRow.team).where(JobRow.id.in_(chunk))).all())
            for job_id in chunk:
                if job_id in teams:  # a folder of a job the store does not know is nobody's share
                    self.finished[job_id] = (teams[job_id], self._measure(job_id))

    def _measure(self, job_id: int) -> int:
        total = folder_bytes(self.jobs_dir / str(job_id))
        if self.work_dir is not None:
            total += folder_bytes(self.work_dir / f"job-{job_id}")
        return total

    def _besides_log(self, job_id: int, log_path: str) -> int:
        """What a job's folders hold besides its log (whose size is read apart, when needed)."""
        try:
            log_blocks = os.stat(log_path).st_blocks * 512 if log_path else 0
        except OSError:
            log_blocks = 0
        return max(0, self._measure(job_id) - log_blocks)

    def _report_cut(self, s: Any, job_id: int, state: str, handle: dict[str, Any]) -> None:
        exit_file = handle.get("exit_file")
        if not exit_file:
            return
        path = f"{exit_file}.cut"
        if path in self._reported:
            return
        try:
            with open(path, "rb") as fh:
                doc = json.loads(fh.read(4096))
        except (OSError, ValueError):
            return
        self._reported.add(path)
        why = str(doc.get("why", ""))[:300] if isinstance(doc, dict) else ""
        kept = int(doc.get("kept", 0)) if isinstance(doc, dict) else 0
        reason = f"log cut at {format_bytes(kept)}: {why}; the job goes on, its further output is discarded"
        s.add(JobEventRow(job_id=job_id, from_state=state, to_state=state, reason=reason))


def _size_of(path: str) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def _read_budget(path: str) -> int:
    """The allowance an attempt's file grants now (0: none written yet, or unreadable)."""
    try:
        with open(path) as fh:
            return int(json.loads(fh.read(4096))["size"])
    except (OSError, ValueError, TypeError, KeyError):
        return 0


def _write_budget(path: str, size: int, why: str) -> None:
    """An attempt's allowance file: the size its log may reach, and why not more (written atomically;
    unchanged content is not rewritten)."""
    doc = json.dumps({"size": size, "why": why})
    try:
        with contextlib.suppress(FileNotFoundError), open(path) as fh:
            if fh.read() == doc:
                return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(doc)
        os.replace(tmp, path)
    except OSError as exc:  # the shim keeps the last allowance it read, and the reserve holds
        log.debug("log allowance %s not written: %s", path, exc)


def enable(service: Any, team_gb: float | None, reserve_mb: float | None) -> DiskShares | None:
    """Keep disk shares for ``service``'s jobs when its executor writes job folders here (the local
    executor); sets ``service.disk`` and returns it (None: not kept, e.g. on Ray or Slurm)."""
    from gpuyard.settings import load_settings

    jobs_dir = getattr(service.executor, "jobs_dir", None)
    if jobs_dir is None or service.executor.name != "local":
        return None  # Ray and Slurm write logs on their nodes, by their own means: no shim cuts them
    home = load_settings().home
    policy = resolve_policy(home, team_gb, reserve_mb)
    isolation = getattr(service.executor, "isolation", None)
    work_dir = None
    root = getattr(isolation, "work_root", None)
    if root is not None and str(Path(root).resolve()).startswith(str(home) + os.sep):
        work_dir = Path(root)
    shares = DiskShares(Path(jobs_dir), policy, work_dir)
    service.disk = shares
    return shares
