"""The job service's reaping: poll running jobs, enforce stop deadlines, record how attempts ended.

What an exit means (cancelled, preempted, failed with restarts left, ...) is the scheduling core's
decision (:func:`gpuyard.scheduler.core.on_exit`); this module reads the executor and writes the
store. Stop requests reach the executor only after their transaction has committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuyard.scheduler.core import JobView, StopReason, on_exit
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.executors.base import Executor, ExecutorUnreachable, ExitStatus
from gpuyard.scheduler.records import move
from gpuyard.scheduler.spec import JobState
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow, JobRow

log = logging.getLogger("gpuyard.scheduler.service")

# Below this many free bytes a filesystem counts as full (a few pages: SQLite and small files fail).
FULL_BELOW_BYTES = 1 << 20


class GraceConfig(Protocol):
    """What reaping reads of the service's configuration."""

    @property
    def grace_s(self) -> float:
        """Seconds from SIGTERM to SIGKILL."""
        ...


class ExitHandling:
    """Reaping and stop requests of :class:`gpuyard.scheduler.service.JobService` (a mixin: the
    attributes below are the service's)."""

    store: Store
    executor: Executor
    config: GraceConfig
    estimator: RuntimeEstimator
    _ended_seen: dict[int, tuple[datetime, str | None]]
    _stops: list[tuple[int, dict[str, Any]]]
    _reconcile_unsure: Callable[[], None]
    _view: Callable[[JobRow], JobView]
    _forget: Callable[[int], None]

    def _reap(self) -> None:
        """Poll every running job and record those that ended. The executor is asked outside any
        transaction (its calls may take long while its controller does not answer; the store's
        write lock is held only for each short write), and each write checks that the job is still
        the attempt that was polled."""
        with self.store.read() as s:
            running = [
                (r.id, r.attempts, dict(r.handle or {}), r.stop_requested, r.stop_deadline, r.killed)
                for r in s.scalars(select(JobRow).where(JobRow.state == JobState.RUNNING.value))
            ]
        self._reconcile_unsure()
        now = utcnow()
        for job_id, attempt, handle, stop_requested, deadline, killed in running:
            status = self.executor.poll(handle)
            if status is None:
                if stop_requested and deadline and now >= deadline and not killed:
                    self._kill(job_id, attempt, handle)
                continue
            if job_id not in self._ended_seen:  # the first sight of its end, kept until recorded
                lost = status.code is None and status.killed and not killed
                disk = unrecorded_exit_disk(handle) if lost else None
                self._ended_seen[job_id] = (utcnow(), disk)
            seen_at, disk = self._ended_seen[job_id]
            if status.ended_at is None:
                status = replace(status, ended_at=seen_at)
            with self.store.session() as s:
                row = s.get(JobRow, job_id)
                if row is not None and row.state == JobState.RUNNING.value and row.attempts == attempt:
                    self._finish(s, row, status, disk)
            self._ended_seen.pop(job_id, None)  # committed: this end is recorded

    def _kill(self, job_id: int, attempt: int, handle: dict[str, Any]) -> None:
        """SIGKILL a job whose grace period after SIGTERM is over (tried again next tick if the
        executor does not answer)."""
        try:
            self.executor.stop(handle, kill=True)
        except ExecutorUnreachable as exc:
            log.warning("job %d: SIGKILL not delivered: %s", job_id, exc)
            return
        with self.store.session() as s:
            row = s.get(JobRow, job_id)
            if row is None or row.state != JobState.RUNNING.value or row.attempts != attempt:
                return
            row.killed = True
            s.add(
                JobEventRow(
                    job_id=row.id,
                    from_state=row.state,
                    to_state=row.state,
                    reason=f"no exit {self.config.grace_s:g} s after SIGTERM: SIGKILL",
                )
            )

    def _finish(self, s: Session, row: JobRow, status: ExitStatus, full_disk: str | None = None) -> None:
        """Record how a job's attempt ended (``full_disk``: the folder whose full disk kept its exit
        code from being written, when that is why there is none)."""
        # The executor's end time when it has one (a job that ended while no server ran), never
        # before the start nor after now.
        end = min(status.ended_at, utcnow()) if status.ended_at else utcnow()
        end = max(end, row.started_at) if row.started_at else end
        ran = max(0.0, (end - row.started_at).total_seconds()) if row.started_at else 0.0
        view = self._view(row)  # as it was when it ended: its stop request, its counts
        outcome = on_exit(view, status, full_disk)
        row.exit_code, row.attained_s = status.code, row.attained_s + ran
        # The placement stays on record (where it last ran); only scheduled/running ones hold GPUs.
        row.stop_requested, row.stop_deadline, row.killed, row.handle = None, None, False, None
        for note in status.notes:  # what else the executor saw (a log cut at its cap)
            s.add(JobEventRow(job_id=row.id, from_state=row.state, to_state=row.state, reason=note))
        for step in outcome.transitions:
            move(s, row, step.to, step.reason, at=end)
        row.failures, row.preemptions = outcome.failures, outcome.preemptions
        if outcome.sample:
            self.estimator.observe(row.team, row.user, row.gpus, row.attained_s)
        if not outcome.keep_resize:
            row.resize_to = None
        if outcome.gpus is not None:
            row.gpus = outcome.gpus  # an elastic job queues at its smallest size
        if outcome.state.terminal:
            self._forget(row.id)

    def _request_stop(self, row: JobRow, why: StopReason) -> None:
        if row.stop_requested:
            return
        row.stop_requested = why.value
        row.stop_deadline = utcnow() + timedelta(seconds=self.config.grace_s)
        if row.handle:
            self._stops.append((row.id, dict(row.handle)))  # sent after the commit (_stop_after)

    @contextlib.contextmanager
    def _stop_after(self) -> Iterator[Session]:
        """A write transaction whose stop requests (``_request_stop``) reach the executor once it has
        committed: no executor call is made while the store's write lock is held (a Slurm controller
        that does not answer would hold it for as long as its tools wait)."""
        self._stops = []
        try:
            with self.store.session() as s:
                yield s
        except BaseException:
            self._stops = []
            raise
        stops, self._stops = self._stops, []
        for job_id, handle in stops:
            try:
                self.executor.stop(handle, kill=False)
            except Exception as exc:  # the stop stays requested: SIGKILL (retried) at its deadline
                log.warning("job %d: SIGTERM not delivered: %s", job_id, exc)


def unrecorded_exit_disk(handle: dict[str, Any]) -> str | None:
    """The folder of a job's exit file when its disk kept the exit code from being written, else None.

    The shim writes ``EXIT_FILE.tmp`` (and its companions, ``EXIT_FILE.*.tmp``) then renames it: a
    ``.tmp`` left behind (the write failed), or a filesystem that is full now, is taken as the reason
    no exit code was recorded.
    """
    exit_file = handle.get("exit_file")
    if not exit_file:
        return None
    folder, name = os.path.split(str(exit_file))
    try:
        left = [f for f in os.listdir(folder) if f.startswith(name) and f.endswith(".tmp")]
    except OSError:
        left = []
    return folder if left or disk_full(folder) else None


def free_bytes(path: str) -> int | None:
    """Bytes free to unprivileged writers on the filesystem of ``path`` (None when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail * st.f_frsize)


def disk_full(path: str) -> bool:
    """Whether the filesystem of ``path`` has less than ``FULL_BELOW_BYTES`` free (False if unknown)."""
    free = free_bytes(path)
    return free is not None and free < FULL_BELOW_BYTES
