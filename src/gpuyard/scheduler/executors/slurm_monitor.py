"""gpuyard's node states kept in step with Slurm's, and Slurm's pending reasons as job events."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from gpuyard.scheduler.executors.base import ExecutorUnreachable
from gpuyard.scheduler.executors.slurm import SlurmExecutor
from gpuyard.scheduler.nodes import DRAINED, HEALTHY, NodeHealthMonitor

log = logging.getLogger("gpuyard.scheduler.executors.slurm")  # the executor's log, as before the split


class SlurmNodeMonitor(NodeHealthMonitor):
    """Keeps gpuyard's node states and Slurm's in step, every ``interval_s`` (in a thread).

    - A node gpuyard drains (an admin's ``gpuyard nodes drain``, a failed check) is drained in Slurm
      with ``gpuyard: <reason>``, and resumed there when gpuyard undrains it.
    - A node Slurm reports down, drained or failing (by its admin, its HealthCheckProgram, a dead
      slurmd) is drained in gpuyard with Slurm's state and reason (source ``slurm``), so nothing new is
      placed there and preemptible jobs move off; it is undrained when Slurm has it back.
    - A gpuyard job Slurm keeps pending gets an event with Slurm's reason when that reason changes.

    gpuyard's own NVML checks do not run on Slurm nodes: Slurm's HealthCheckProgram is the place for
    them there.
    """

    def __init__(self, service: Any, executor: SlurmExecutor, interval_s: float = 5.0) -> None:
        from gpuyard.hardware.health import NodeCheckConfig

        super().__init__(service.node_states, "slurm", NodeCheckConfig(interval_s=interval_s))
        self.service, self.executor = service, executor
        self.names = {n.name for n in service.nodes}
        self._pending: dict[int, str] = {}
        self._unanswered = False  # Slurm did not answer the last check (said once per outage)

    def describe(self) -> str:
        return (
            f"node states of {len(self.names)} Slurm nodes kept in step with Slurm every "
            f"{self.config.interval_s:g} s"
        )

    def check_once(self, busy: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        return self.check_nodes({})

    def check_nodes(self, used: Mapping[str, Collection[int]]) -> dict[str, dict[str, Any]]:
        states = self.states
        docs = {d["node"]: d for d in states.states(sorted(self.names))}
        try:
            down = self.executor.unavailable_nodes()
        except ExecutorUnreachable as exc:  # unknown: every node keeps its state until Slurm answers
            if not self._unanswered:
                log.warning("node states not synced with Slurm: %s", exc)
            self._unanswered = True
            return docs
        self._unanswered = False
        slurm_down = {n: why for n, why in down.items() if n in self.names}
        for node, why in slurm_down.items():
            if "gpuyard:" in why:
                continue  # our own drain, seen from Slurm
            if docs[node]["state"] != DRAINED:
                docs[node] = states._change(node, DRAINED, f"Slurm: {why}", "slurm", "slurm", keep_same=False)
        for node, doc in docs.items():
            if doc["state"] == DRAINED and doc["source"] == "slurm" and node not in slurm_down:
                docs[node] = states._change(
                    node, HEALTHY, "Slurm has it back", "slurm", "slurm", keep_same=False
                )
        ours = {
            n: d["reason"] or "drained"
            for n, d in docs.items()
            if d["state"] == DRAINED and d["source"] != "slurm"
        }
        self.executor.sync_drains(ours)
        self._note_pending()
        return docs

    def _note_pending(self) -> None:
        from gpuyard.store.tables.jobs import JobEventRow

        try:
            waiting = self.executor.pending_reasons()
        except ExecutorUnreachable:
            return
        changed = {j: r for j, r in waiting.items() if self._pending.get(j) != r}
        self._pending = waiting
        if not changed:
            return
        with self.service.store.session() as s:
            for job_id, reason in changed.items():
                s.add(
                    JobEventRow(
                        job_id=job_id,
                        from_state="running",
                        to_state="running",
                        reason=f"pending in Slurm: {reason}",
                    )
                )
