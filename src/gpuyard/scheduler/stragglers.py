"""The job service's straggler restarts: a running job's launcher names a rank that stays slower;
the job is stopped and requeued to run without that rank's node when it can start elsewhere now."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy.orm import Session

from gpuyard.scheduler.core import JobView, SchedulerCore, StopReason
from gpuyard.scheduler.executors.base import Executor
from gpuyard.scheduler.placement import ClusterState, place
from gpuyard.scheduler.spec import JobState
from gpuyard.states import straggler_measured
from gpuyard.store.tables.jobs import JobEventRow, JobRow


class Stragglers:
    """Straggler restarts of :class:`gpuyard.scheduler.service.JobService` (a mixin: the attributes
    below are the service's)."""

    executor: Executor
    core: SchedulerCore
    state: ClusterState
    wake: threading.Event
    _lock: threading.RLock
    _node_index: dict[str, int]
    _stop_after: Callable[[], AbstractContextManager[Session]]
    _request_stop: Callable[[JobRow, StopReason], None]
    _row: Callable[[Session, int], JobRow]
    _view: Callable[[JobRow], JobView]
    _views: Callable[[Session], list[JobView]]

    def report_straggler(self, job_id: int, report: dict[str, Any]) -> dict[str, Any]:
        """A running job's launcher names a rank that stays slower (``gpuyard.train.straggler``).

        The report becomes an event on the job. With ``on_straggler: restart`` the job is also stopped
        (SIGTERM: it checkpoints) and requeued to run without that rank's node, when the node is one of
        the job's, the job spans other GPUs it could use, and a placement of its size without that node
        (and the nodes it already avoids) is free now counting its own GPUs elsewhere; else the event
        says why it stays.

        Args:
            report: ``rank``, ``node`` (the scheduler's name of the rank's node), ``cause`` (data,
                compute or link), ``slowdown`` (x the other ranks' median) and ``step``.

        Returns:
            ``{"restarting": bool, "reason": str}``.
        """
        node = str(report["node"])
        if report["cause"] == "link":  # a collective wait measured, not a rank's own work
            waits = straggler_measured("link", float(report["slowdown"]))
            what = f"straggler: rank {report['rank']} on node {node}: {waits} (cause: link)"
            what += f" at step {report['step']}"
        else:
            what = (
                f"straggler: rank {report['rank']} on node {node} is {float(report['slowdown']):.2f}x slower "
                f"than the median rank (cause: {report['cause']}) at step {report['step']}"
            )
        with self._lock, self._stop_after() as s:
            row = self._row(s, job_id)
            restart, why = self._straggler_restart(s, row, node)
            if restart:
                row.avoid_nodes = sorted({*(row.avoid_nodes or []), node})
                self._request_stop(row, StopReason.STRAGGLER)
            note = f"{what}; {why}"
            s.add(
                JobEventRow(job_id=job_id, from_state=row.state, to_state=row.state, reason=note, data=report)
            )
        if restart:
            self.wake.set()
        return {"restarting": restart, "reason": note}

    def _straggler_restart(self, s: Session, row: JobRow, node: str) -> tuple[bool, str]:
        """Whether to restart ``row`` without ``node`` now, and why (not)."""
        if row.spec.get("on_straggler", "report") != "restart":
            return False, "reported (on_straggler: report)"
        if row.state != JobState.RUNNING.value or row.stop_requested:
            return (
                False,
                f"not restarted: the job is {row.state}{' and stopping' if row.stop_requested else ''}",
            )
        job = self._view(row)
        if node not in job.on_nodes() or node not in self._node_index:
            return False, f"not restarted: node {node} is not one of the job's"
        self.core.hold(self.state, self._views(s))
        work = self.state.copy()
        work.release(self.core.running(job, time.time()).placement)
        avoid = {self._node_index[n] for n in job.avoid_nodes if n in self._node_index}
        work.drain_more(avoid | {self._node_index[node]})
        res = job.spec.resources
        need = job.sizes[0]  # an elastic job: its smallest size
        if place(work, need, res.gpu_type, res.cpus, self.executor.multi_node) is None:
            return False, f"not restarted: no placement of {need} GPUs without node {node} is free now"
        return True, f"restarting without node {node} (checkpoint, requeue)"
