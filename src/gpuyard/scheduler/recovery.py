"""The job service's recovery: after a (re)start, adopt the jobs still running and requeue the rest;
and settle the launches whose submission got no answer once the executor answers again."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy import select

from gpuyard.scheduler.executors.base import Executor, ExecutorUnreachable
from gpuyard.scheduler.records import ACTIVE, move
from gpuyard.scheduler.spec import JobState
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow, JobRow


class Recovery:
    """Recovery of :class:`gpuyard.scheduler.service.JobService` (a mixin: the attributes below are
    the service's)."""

    store: Store
    executor: Executor
    wake: threading.Event
    _lock: threading.RLock
    claim: Callable[[], None]

    def recover(self) -> dict[str, int]:
        """After a (re)start: adopt jobs still running (reaped as usual if they ended), requeue the rest.

        Raises:
            ConflictError: another live service holds the scheduler lease (its jobs are not orphans).
        """
        self.claim()
        counts = {"adopted": 0, "requeued": 0}
        with self._lock, self.store.session() as s:
            for row in s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE))):
                handle = row.handle or {}
                if not handle.get("launched"):
                    try:
                        found = self.executor.recover(row.id, handle)
                    except ExecutorUnreachable as exc:
                        # Unknown whether it was submitted: it stays scheduled (its GPUs held) and
                        # the tick asks again (_reconcile_unsure) until the controller answers.
                        row.handle = {**handle, "unsure": str(exc)}
                        counts["adopted"] += 1
                        continue
                    if found is None:
                        row.handle, row.placement = None, None
                        move(s, row, JobState.QUEUED, "server restarted before the launch was recorded")
                        counts["requeued"] += 1
                        continue
                    row.handle = found
                    if row.state == JobState.SCHEDULED.value:
                        row.started_at = row.started_at or utcnow()
                        move(s, row, JobState.RUNNING, "launched before the server restarted")
                s.add(
                    JobEventRow(
                        job_id=row.id,
                        from_state=row.state,
                        to_state=row.state,
                        reason="adopted after a server restart",
                    )
                )
                counts["adopted"] += 1
        self.wake.set()
        return counts

    def _reconcile_unsure(self) -> None:
        """Scheduled jobs whose submission got no answer: running if the executor finds them now,
        queued again if it answers that it has no such job; left as they are while it does not."""
        with self.store.read() as s:
            unsure = [
                (r.id, r.attempts, dict(r.handle or {}))
                for r in s.scalars(select(JobRow).where(JobRow.state == JobState.SCHEDULED.value))
                if (r.handle or {}).get("unsure")
            ]
        for job_id, attempt, handle in unsure:
            try:
                found = self.executor.recover(job_id, handle)
            except ExecutorUnreachable:
                continue
            with self.store.session() as s:
                row = s.get(JobRow, job_id)
                if row is None or row.state != JobState.SCHEDULED.value or row.attempts != attempt:
                    continue
                if found is None:
                    row.handle, row.placement = None, None
                    move(s, row, JobState.QUEUED, f"not launched ({handle['unsure']}); queued again")
                else:
                    row.handle, row.started_at = found, utcnow()
                    move(s, row, JobState.RUNNING, f"attempt {attempt} (its submission was found)")
