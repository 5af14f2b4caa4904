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
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from gpuyard.scheduler.executors.base import (
    Executor,
    ExitStatus,
    LaunchPlan,
    MpsConfig,
    NodeSlots,
    job_argv,
    job_env,
)
from gpuyard.scheduler.executors.isolation import JobIsolation
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
            env = iso.environment(env, cwd)
            extra.update(
                job_file=str(folder / f"attempt-{attempt}.job.json"), user=iso.user, uid=iso.uid, gid=iso.gid
            )
        return LaunchPlan(
            job_id=job_id,
            attempt=attempt,
            # An elastic job runs one rank per GPU it got this attempt.
            argv=job_argv(spec, nproc=len(gpus) if spec.resources.elastic and gpus else None),
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
            iso.prepare(plan.job_id, plan.cwd)
            job: dict[str, Any] = {"env": plan.env, "cwd": plan.cwd, "uid": None, "gid": None}
            if iso.switch:
                job.update(uid=iso.uid, gid=iso.gid)
            _write_private(Path(plan.extra["job_file"]), json.dumps(job))
            env, cwd = dict(os.environ), str(Path(plan.log_path).parent)
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

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while the shim lives; then the command's exit code from the exit file (none: killed)."""
        handle = self._resolve(handle)
        pid = handle.get("pid")
        if pid is None:
            return _from_files(handle, lost=True)
        child = self._children.get(pid)
        if child is not None:
            if child.poll() is None:
                return None
            del self._children[pid]
        elif _alive(pid, handle.get("create_time")):
            return None
        return _from_files(handle, lost=False)

    def stop(self, handle: dict[str, Any], kill: bool) -> None:
        """SIGTERM (or SIGKILL) to the job's whole process group."""
        pid = self._resolve(handle).get("pid")
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


def _from_files(handle: dict[str, Any], lost: bool) -> ExitStatus:
    try:
        exit_file = Path(handle["exit_file"])
        code = int(exit_file.read_text())
        ended = datetime.fromtimestamp(exit_file.stat().st_mtime, timezone.utc)
        return ExitStatus(code=code, ended_at=ended)
    except (OSError, ValueError, KeyError):
        # No exit code written: the group was SIGKILLed, or (lost) it never started.
        return ExitStatus(code=None, killed=not lost, lost=lost)
