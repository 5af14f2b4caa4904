"""The local executor: each job a process group on this machine, logs to files, exit codes kept on disk.

Each job runs under a small shim (``shim.py``) that leads the process group, writes its pid at start
and the command's exit code at the end. The files make the server restart-safe: a new server reads
the pid back (adopting a job still running) or the exit code (of a job that ended meanwhile).

With a :class:`~gpuyard.scheduler.executors.isolation.JobIsolation` (`gpuyard server`) a job gets an
allow-listed environment, a working directory of its own and, when the server is root, an unprivileged
Unix user; without one (a job service inside a user's own command) it inherits that command's
environment and working directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from gpuyard import privileged
from gpuyard.scheduler.executors import limits as job_limits
from gpuyard.scheduler.executors.base import (
    Executor,
    ExitStatus,
    LaunchPlan,
    MpsConfig,
    NodeSlots,
    job_argv,
    job_env,
)
from gpuyard.scheduler.executors.isolation import PRIVATE_TMP_VARS, JobIsolation, private_tmp_env
from gpuyard.scheduler.spec import JobSpec

SHIM = Path(__file__).with_name("shim.py")


class LocalExecutor(Executor):
    """Runs jobs as local process groups; ``jobs_dir`` holds one folder per job (log, pid, exit files)."""

    name = "local"
    multi_node = False

    def __init__(
        self, jobs_dir: Path, isolation: JobIsolation | None = None, mps: MpsConfig | None = None
    ) -> None:
        self.jobs_dir = Path(jobs_dir)
        self.isolation = isolation
        # Share jobs join this MPS daemon (default: GPUYARD_MPS_PIPE_DIRECTORY); none: time-slicing.
        self.mps = mps if mps is not None else MpsConfig.from_env()
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def plan(self, job_id: int, spec: JobSpec, nodes: list[NodeSlots], attempt: int) -> LaunchPlan:
        """The command, environment and files of one attempt (nothing is started).

        Isolated, ``env`` is the job's whole environment and ``extra`` names its user; else ``env`` is
        added to this process's environment.
        """
        folder = self.jobs_dir / str(job_id)
        gpus = nodes[0].gpus if nodes else ()
        env = job_env(job_id, spec, attempt, gpus, nodes[0] if nodes else None, self.mps)
        extra: dict[str, Any] = {
            "pid_file": str(folder / f"attempt-{attempt}.pid"),
            "exit_file": str(folder / f"attempt-{attempt}.exit"),
        }
        iso = self.isolation
        if iso is None:
            cwd = spec.workdir or os.getcwd()
        else:
            iso = iso.for_job(spec.team, spec.user)  # a --job-user template: the team's own user
            cwd = spec.workdir or str(iso.workdir(job_id))
            # A temp folder of the attempt's own: TMPDIR and the compiler caches point into it, and
            # with a mount namespace it is the job's /tmp (see _confine); removed when it ends.
            tmp = iso.tmpdir(job_id, attempt, secrets.token_hex(4))
            env = iso.environment({**private_tmp_env(tmp, env), **env}, cwd)
            extra["tmp"] = str(tmp)
            extra.update(
                job_file=str(folder / f"attempt-{attempt}.job.json"), user=iso.user, uid=iso.uid, gid=iso.gid
            )
            if spec.train is not None and iso.switch:
                extra["python"] = iso.python  # checked at launch: the job's user must run it
            if iso.confinement is not None:
                extra["limits"] = asdict(iso.confinement.defaults.for_spec(spec))
                # A name nobody can guess or make beforehand; the server creates it at launch.
                name = f"gpuyard-job-{job_id}-{attempt}-{secrets.token_hex(4)}"
                cgroup = iso.confinement.cgroups.handle(name)
                if cgroup:
                    extra["cgroup"] = cgroup
        return LaunchPlan(
            job_id=job_id,
            attempt=attempt,
            # An elastic job runs one rank per GPU it got this attempt.
            argv=job_argv(
                spec,
                nproc=len(gpus) if spec.resources.elastic and gpus else None,
                python=iso.python if iso is not None else None,
            ),
            env=env,
            cwd=cwd,
            log_path=str(folder / "output.log"),
            nodes=nodes,
            executor=self.name,
            extra=extra,
        )

    def launch(self, plan: LaunchPlan) -> dict[str, Any]:
        """Start the shim (and through it the command) in a new session; stdout+stderr to the log."""
        Path(plan.log_path).parent.mkdir(parents=True, exist_ok=True)
        files = [plan.extra["pid_file"], plan.extra["exit_file"]]
        iso = self.isolation
        if iso is None:
            env, cwd = {**os.environ, **plan.env}, plan.cwd
        else:
            # The shim keeps the server's environment (run with -I, nothing of the job's reaches it); the
            # command gets plan.env, the job's user and its working directory from the job file.
            if iso.template is not None:  # the user plan() resolved for this job
                iso = replace(
                    iso,
                    user=plan.extra["user"],
                    uid=int(plan.extra["uid"]),
                    gid=int(plan.extra["gid"]),
                    template=None,
                )
            if plan.extra.get("python"):
                iso.check_python()
            iso.prepare(plan.job_id, plan.cwd)
            if plan.extra.get("tmp"):
                iso.make_tmp(Path(plan.extra["tmp"]))
            job: dict[str, Any] = {"env": plan.env, "cwd": plan.cwd, "uid": None, "gid": None}
            if iso.switch:
                job.update(uid=iso.uid, gid=iso.gid)
            if iso.confinement is not None and "limits" in plan.extra:
                job.update(self._confine(plan, iso))
                if job["namespace"].get("tmp"):  # its temp folder is its /tmp: the job names it so
                    job["env"] = _inside_tmp(plan.env, plan.extra["tmp"])
            _write_private(Path(plan.extra["job_file"]), json.dumps(job))
            # The shim runs as the server: the privileged allow-list (it is -I anyway), never the job's.
            env, cwd = privileged.environment(), str(Path(plan.log_path).parent)
            files += ["--job", plan.extra["job_file"]]
        cmd = [sys.executable, "-I", "-S", str(SHIM), *files, "--", *plan.argv]
        with open(plan.log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        self._children[proc.pid] = proc
        return {
            **plan.extra,
            "pid": proc.pid,
            "create_time": _create_time(proc.pid),
            "log": plan.log_path,
            "launched": True,
        }

    def _confine(self, plan: LaunchPlan, iso: JobIsolation) -> dict[str, Any]:
        """The shim's part of the job file for the attempt's limits; its cgroup created.

        Raises:
            RuntimeError: the cgroup could not be made (the launch, and so the attempt, fails with why).
        """
        conf = iso.confinement
        assert conf is not None
        limits = job_limits.JobLimits(**plan.extra["limits"])
        cgroup = plan.extra.get("cgroup") or {}
        if cgroup:
            try:
                job_limits.create(cgroup, limits)
            except OSError as exc:
                raise RuntimeError(
                    f"cannot create the job's cgroup {exc.filename or cgroup['dirs'][0]}: {exc.strerror}"
                ) from None
        uid = iso.uid if iso.switch else os.geteuid()
        namespace: dict[str, Any] = dict(conf.namespace)
        if namespace and iso.switch and plan.extra.get("tmp") and _own_tmp_fits(plan.cwd, iso, plan.job_id):
            # Its temp folder becomes its /tmp; its own job folder stays where it is when that is
            # under /tmp (the shim binds it back into the private one).
            namespace.update(tmp=plan.extra["tmp"], keep=[plan.cwd] if _under_tmp(plan.cwd) else [])
        return {
            "cgroup": cgroup,
            "rlimits": job_limits.rlimits(limits, conf.cgroups, uid),
            "log_cap": limits.log_bytes,
            # The server's disk shares (gpuyard.scheduler.diskshare), when it keeps them.
            "log_budget": plan.extra.get("log_budget"),
            "disk_reserve": plan.extra.get("disk_reserve"),
            "namespace": namespace,
        }

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while the shim lives; then the command's exit code from the exit file (none: killed),
        with why when known (out of memory, could not start), its cgroup removed."""
        handle = self._resolve(handle)
        pid = handle.get("pid")
        if pid is None:
            return _ended(handle, lost=True)
        child = self._children.get(pid)
        if child is not None:
            if child.poll() is None:
                return None
            del self._children[pid]
        elif _alive(pid, handle.get("create_time")):
            return None
        return _ended(handle, lost=False)

    def stop(self, handle: dict[str, Any], kill: bool) -> None:
        """SIGTERM (or SIGKILL) to the job's whole process group; a kill also ends what of the job
        left the group (every process in its cgroup)."""
        pid = self._resolve(handle).get("pid")
        if kill and handle.get("cgroup"):
            job_limits.kill_all(handle["cgroup"], timeout_s=1.0)
        if pid is None or not _alive(pid, handle.get("create_time")):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL if kill else signal.SIGTERM)

    def recover(self, job_id: int, plan_hint: dict[str, Any] | None) -> dict[str, Any] | None:
        """A handle for a job whose launch the server did not get to record (its pid file tells)."""
        if not plan_hint:
            return None
        handle = self._resolve(plan_hint)
        if "pid" in handle or Path(handle.get("exit_file", "/nonexistent")).exists():
            return {**handle, "launched": True}
        return None

    def _resolve(self, handle: dict[str, Any]) -> dict[str, Any]:
        if handle.get("pid") is None and handle.get("pid_file"):
            try:
                pid = int(Path(handle["pid_file"]).read_text())
            except (OSError, ValueError):
                return handle
            handle = {**handle, "pid": pid, "create_time": _create_time(pid)}
        return handle


def _inside_tmp(env: dict[str, str], folder: str) -> dict[str, str]:
    """``env`` with paths into ``folder`` (the attempt's temp folder) as the job sees them: in /tmp."""
    out = dict(env)
    for key, value in env.items():
        if key in PRIVATE_TMP_VARS and (value == folder or value.startswith(folder + "/")):
            out[key] = "/tmp" + value[len(folder) :]
    return out


def _under_tmp(path: str) -> bool:
    return path == "/tmp" or path.startswith("/tmp/")


def _own_tmp_fits(cwd: str, iso: JobIsolation, job_id: int) -> bool:
    """Whether the job can have a private /tmp: not when it works in a folder of its choosing under the
    machine's /tmp (hidden by a private one; TMPDIR and the caches are private all the same)."""
    return not _under_tmp(cwd) or cwd == str(iso.workdir(job_id))


def _remove_tmp(handle: dict[str, Any]) -> None:
    """Remove an attempt's temp folder. shutil.rmtree walks it by descriptors and never follows a link
    the job left there; the folder itself is in the work root, which only the server can change."""
    tmp = handle.get("tmp")
    if tmp and os.path.isdir(tmp) and not os.path.islink(tmp):
        assert shutil.rmtree.avoids_symlink_attacks
        shutil.rmtree(tmp, ignore_errors=True)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid: int, create_time: float | None) -> bool:
    # The create time tells our process from a new one that got the same pid after a reboot.
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 1.0:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ended(handle: dict[str, Any], lost: bool) -> ExitStatus:
    """The end of an attempt: its exit, why (from the shim's ``.why`` file, the cgroup's OOM count,
    the log's last line for a command that could not run), its cgroup removed."""
    status = _from_files(handle, lost)
    why: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        why = dict(json.loads(Path(handle["exit_file"] + ".why").read_text()))
    cgroup = handle.get("cgroup") or {}
    ooms = int(why.get("oom_kills") or 0)
    if cgroup:
        ooms = max(ooms, job_limits.oom_kills(cgroup))
        job_limits.remove(cgroup)
    _remove_tmp(handle)
    limits = job_limits.JobLimits(**handle["limits"]) if handle.get("limits") else job_limits.JobLimits()
    reason, notes = "", []
    code = status.code
    if why.get("start_error"):
        reason = str(why["start_error"])
    elif ooms and code != 0:
        reason = limits.oom_reason()
        if code is not None and code > 0:
            reason = f"exit code {code} after {reason} (a process of the job was killed)"
    elif code in (126, 127):
        last = _last_line(handle.get("log"))
        reason = f"exit code {code}: {last}" if last else f"exit code {code} (the command could not run)"
    cut = why.get("log_cut")
    if isinstance(cut, dict) and cut.get("why"):  # the team's disk quota or the disk's reserve
        notes.append(
            f"log cut at {job_limits.format_bytes(int(cut.get('kept', 0)))} ({str(cut['why'])[:300]}): "
            f"{int(cut.get('dropped', 0))} more bytes of output discarded"
        )
    elif isinstance(cut, dict) and limits.log_bytes:
        notes.append(
            f"log cut at {job_limits.format_bytes(limits.log_bytes)} (--job-log-mb): "
            f"{int(cut.get('dropped', 0))} more bytes of output discarded"
        )
    return replace(status, reason=reason, notes=tuple(notes))


def _last_line(log_path: str | None, limit: int = 200) -> str:
    """The last non-empty line of a log (its last 4 KiB), printable characters only."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log_path) - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return "".join(c if c.isprintable() else "?" for c in text)[:limit]


def _from_files(handle: dict[str, Any], lost: bool) -> ExitStatus:
    try:
        exit_file = Path(handle["exit_file"])
        code = int(exit_file.read_text())
        ended = datetime.fromtimestamp(exit_file.stat().st_mtime, timezone.utc)
        return ExitStatus(code=code, ended_at=ended)
    except (OSError, ValueError, KeyError):
        # No exit code written: the group was SIGKILLed, or (lost) it never started.
        return ExitStatus(code=None, killed=not lost, lost=lost)
