"""Task executors: run ``module:function`` calls (trials, folds, pipeline stages) and return futures.

A :class:`Task` is a JSON-serialisable call ``fn(**kwargs)`` with ``fn`` a ``module:function``
reference. Model management's searches and cross-validations and the pipeline runner use it. A
:class:`TaskExecutor` is not a second job executor: it hands out futures of calls, and where a task
becomes a process that the scheduler runs (:class:`JobExecutor`), the scheduler's one executor base
(:class:`gpuyard.scheduler.executors.base.Executor`) carries out its launch plan. A task can run
these ways, all through :class:`TaskExecutor`:

- :class:`LocalPoolExecutor`: a pool of spawned worker processes (the default: workers are reused, so
  torch and the dataset are loaded once per worker);
- :class:`SubprocessExecutor`: one ``python -m gpuyard.scheduler.executors.worker TASK RESULT`` process
  per task, which is exactly the command line a scheduled job would run;
- :class:`InlineExecutor`: in this process, one after another (tests, debugging);
- :class:`JobExecutor`: each task a job of the gpuyard scheduler (``gpuyard server``'s job API, or a
  ``JobService`` in this process), whose command is ``task.argv(...)``; the future resolves from the
  result file when the job ends. The scheduler then decides how many run at once and where.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.scheduler.spec import JobState

EXECUTORS = ("pool", "subprocess", "inline", "jobs")
WORKER_MODULE = "gpuyard.scheduler.executors.worker"  # the process that runs one task


@dataclass(frozen=True)
class Task:
    """One job of a search or a cross-validation: call ``fn(**kwargs)`` in a worker."""

    fn: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = "task"

    def to_json(self) -> str:
        """The task as JSON (what a job's task file holds)."""
        return json.dumps(asdict(self))

    def argv(self, task_file: str | Path, result_file: str | Path) -> list[str]:
        """The command line that runs this task as a process (or a scheduled job)."""
        return [sys.executable, "-m", WORKER_MODULE, str(task_file), str(result_file)]


class TaskFailed(GpuyardError):
    """A task raised in its worker; the message carries the worker's error."""


def run_task(task_json: str) -> Any:
    """Run a task in the current process and return its JSON-ready result (the worker's body)."""
    from gpuyard.refs import import_ref

    doc = json.loads(task_json)
    return import_ref(doc["fn"])(**doc["kwargs"])


def _init_worker() -> None:
    # Two workers on two cores: each gets one intra-op thread instead of fighting over both. Set in
    # the environment, read by torch and BLAS when a task imports them (sklearn tasks never pay torch).
    os.environ["OMP_NUM_THREADS"] = "1"


class TaskExecutor(ABC):
    """Runs tasks, up to ``parallel`` at a time; ``submit`` returns a future of the task's result."""

    parallel: int = 1

    @abstractmethod
    def submit(self, task: Task) -> Future[Any]:
        """Start ``task``; the future raises :class:`TaskFailed` when the task fails."""

    def shutdown(self) -> None:  # noqa: B027  (optional hook; nothing to release by default)
        """Release workers."""

    def __enter__(self) -> TaskExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class InlineExecutor(TaskExecutor):
    """Runs each task at once in this process."""

    def submit(self, task: Task) -> Future[Any]:
        """Run now; the returned future is already done."""
        fut: Future[Any] = Future()
        try:
            fut.set_result(run_task(task.to_json()))
        except Exception as exc:
            fut.set_exception(TaskFailed(f"{task.name}: {type(exc).__name__}: {exc}"))
        return fut


class LocalPoolExecutor(TaskExecutor):
    """A pool of ``parallel`` spawned processes (spawn: forking a process that holds torch is unsafe)."""

    def __init__(self, parallel: int) -> None:
        import multiprocessing as mp

        self.parallel = parallel
        self._pool = ProcessPoolExecutor(
            parallel, mp_context=mp.get_context("spawn"), initializer=_init_worker
        )

    def submit(self, task: Task) -> Future[Any]:
        """Queue ``task`` on the pool."""
        out: Future[Any] = Future()
        inner = self._pool.submit(run_task, task.to_json())

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                out.set_result(f.result())
            else:
                out.set_exception(TaskFailed(f"{task.name}: {type(exc).__name__}: {exc}"))

        inner.add_done_callback(done)
        return out

    def shutdown(self) -> None:
        """Stop the workers (cancelling queued tasks)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class SubprocessExecutor(TaskExecutor):
    """One ``python -m gpuyard.scheduler.executors.worker`` process per task, at most ``parallel`` at once."""

    def __init__(self, parallel: int) -> None:
        self.parallel = parallel
        self._threads = ThreadPoolExecutor(parallel, thread_name_prefix="gpuyard-task")
        self._tmp = tempfile.TemporaryDirectory(prefix="gpuyard-tasks-")
        self._count = 0
        self._lock = threading.Lock()

    def _run(self, task: Task, index: int) -> Any:
        folder = Path(self._tmp.name)
        task_file, result_file = folder / f"{index}.task.json", folder / f"{index}.result.json"
        task_file.write_text(task.to_json())
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(task.argv(task_file, result_file), capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not result_file.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            raise TaskFailed(f"{task.name}: {tail[0]}")
        return json.loads(result_file.read_text())["result"]

    def submit(self, task: Task) -> Future[Any]:
        """Start the task's process when a slot is free."""
        with self._lock:
            self._count += 1
            index = self._count
        return self._threads.submit(self._run, task, index)

    def shutdown(self) -> None:
        """Wait for running processes and remove the task files."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._tmp.cleanup()


class JobExecutor(TaskExecutor):
    """Each task a scheduler job running ``python -m gpuyard.scheduler.executors.worker TASK RESULT``.

    ``jobs`` is anything with ``submit(JobSpec) -> {"id": ...}`` and ``get(id) -> {"state": ...}``:
    :class:`gpuyard.scheduler.client.JobClient` (a running ``gpuyard server``) or a
    :class:`gpuyard.scheduler.service.JobService`. Task and result files go to ``folder``, which the
    job's process must see (local disk for this machine; a shared folder for a cluster).
    """

    def __init__(self, jobs: Any, folder: str | Path, *, cpus: int = 1, poll_s: float = 0.2) -> None:
        self.jobs, self.folder, self.cpus, self.poll_s = jobs, Path(folder), cpus, poll_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self.parallel = 1  # the scheduler decides concurrency; this only bounds the waiting threads
        self._waiters = ThreadPoolExecutor(64, thread_name_prefix="gpuyard-job-wait")

    def submit(self, task: Task) -> Future[Any]:
        """Submit ``task`` as a job; the future completes when the job does."""
        import re
        import uuid

        from gpuyard.scheduler.spec import JobSpec

        tag = uuid.uuid4().hex[:10]
        task_file, result_file = self.folder / f"{tag}.task.json", self.folder / f"{tag}.result.json"
        task_file.write_text(task.to_json())
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"task-{task.name}")[:80].strip("-") + f"-{tag[:6]}"
        spec = JobSpec.model_validate(
            {
                "name": name,
                "command": task.argv(task_file, result_file),
                "resources": {"gpus": 0, "cpus": self.cpus},
                "env": {"OMP_NUM_THREADS": "1"},
            }
        )
        job_id = self.jobs.submit(spec)["id"]
        return self._waiters.submit(self._wait, task, job_id, result_file)

    def _wait(self, task: Task, job_id: Any, result_file: Path) -> Any:
        import time

        while True:
            doc = self.jobs.get(job_id)
            if JobState(doc["state"]).terminal:
                break
            time.sleep(self.poll_s)  # polling the job's state: the scheduler has no completion callback
        if doc["state"] != JobState.SUCCEEDED or not result_file.exists():
            why = doc.get("reason") or f"exit code {doc.get('exit_code')}"
            raise TaskFailed(f"{task.name}: job {job_id} {doc['state']}: {why}")
        return json.loads(result_file.read_text())["result"]

    def shutdown(self) -> None:
        """Stop waiting (jobs already submitted keep running in the scheduler)."""
        self._waiters.shutdown(wait=False, cancel_futures=True)


def get_executor(name: str, parallel: int) -> TaskExecutor:
    """The executor called ``name`` running ``parallel`` tasks at once.

    ``pool``, ``subprocess`` and ``inline`` run here; ``jobs`` submits each task to the gpuyard server
    at ``GPUYARD_SERVER`` (``gpuyard server`` must be running), which runs as many as it places.

    Raises:
        ConfigError: unknown name or parallel < 1.
    """
    if parallel < 1:
        raise ConfigError(f"parallel must be at least 1, got {parallel}")
    if name == "pool":
        return LocalPoolExecutor(parallel)
    if name == "subprocess":
        return SubprocessExecutor(parallel)
    if name == "inline":
        return InlineExecutor()
    if name == "jobs":
        from gpuyard.scheduler.client import JobClient
        from gpuyard.settings import load_settings

        settings = load_settings()
        return JobExecutor(JobClient(settings.server_url), settings.ensure_home() / "tasks")
    raise ConfigError(f"unknown executor {name!r}: use one of {', '.join(EXECUTORS)}")
