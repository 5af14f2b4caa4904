"""The job service's launches: a planned start becomes GPU slots, a recorded placement, an executor
launch and, once it answers, a running job (or a queued one again when its controller refused)."""

from __future__ import annotations

from typing import Any

from gpuyard.auth import TOKEN_ENV, create_job_token
from gpuyard.errors import NotFoundError
from gpuyard.scheduler.executors.base import Executor, ExecutorUnreachable, NodeSlots
from gpuyard.scheduler.placement import NodeSpec, Placement, record_part
from gpuyard.scheduler.records import move
from gpuyard.scheduler.spec import JobSpec, JobState
from gpuyard.settings import SERVER_ENV
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow, JobRow


class Launching:
    """Launches of :class:`gpuyard.scheduler.service.JobService` (a mixin: the attributes below are
    the service's)."""

    store: Store
    executor: Executor
    nodes: list[NodeSpec]
    api_url: str | None
    disk: Any

    def _start(self, job_id: int, placement: Placement, slots: list[NodeSlots]) -> None:
        with self.store.session() as s:
            # Locked (PostgreSQL; SQLite's write lock already covers it) so that a start racing a
            # scheduler that just lost its lease sees the other's move and does not start it twice.
            row = s.get(JobRow, job_id, with_for_update=True)
            if row is None or row.state != JobState.QUEUED.value:
                return
            spec = JobSpec.model_validate(row.spec)
            plan = self.executor.plan(job_id, spec, slots, row.attempts + 1)
            if self.disk is not None:
                self.disk.grant(job_id, plan.extra, plan.log_path, spec.team)  # its log's share of the disk
            row.attempts += 1
            how = placement.how
            if spec.resources.elastic:
                row.gpus, row.resize_to = placement.gpus, None
                how += f"; {placement.gpus} GPUs of {spec.resources.gpus}-{spec.resources.gpus_max}"
            row.placement = {
                "how": placement.how,
                "nodes": [record_part(sl.node, sl.gpus, sl.cpus, _parts_on(placement, sl)) for sl in slots],
            }
            if placement.predicted is not None:
                row.placement["predicted"] = placement.predicted.to_dict()
            row.handle, row.log_path = dict(plan.extra), plan.log_path
            move(s, row, JobState.SCHEDULED, how)
            if self.api_url is not None:
                # A token for this attempt only, reaching only this job (never the submitter's own).
                token = create_job_token(s, job_id, row.user)
                if token is not None:
                    plan.env.update({TOKEN_ENV: token, SERVER_ENV: self.api_url})
        try:
            handle = self.executor.launch(plan)
        except ExecutorUnreachable as exc:
            with self.store.session() as s:
                row = _row(s.get(JobRow, job_id), job_id)
                if exc.submitted is None:  # it may have reached the controller: found, or not, later
                    row.handle = {**(row.handle or {}), "unsure": str(exc)}
                    note = f"submission unanswered ({exc}): looked for in Slurm when it answers"
                    s.add(JobEventRow(job_id=job_id, from_state=row.state, to_state=row.state, reason=note))
                else:  # refused before it was sent: this attempt never was
                    row.placement, row.handle, row.attempts = None, None, row.attempts - 1
                    move(s, row, JobState.QUEUED, f"not launched: {exc}; waits for it to answer")
            return
        except Exception as exc:  # any other launch failure is the job's failure, recorded with why
            with self.store.session() as s:
                row = _row(s.get(JobRow, job_id), job_id)
                row.placement, row.handle = None, None
                move(s, row, JobState.FAILED, f"launch failed: {exc}")
            return
        with self.store.session() as s:
            row = _row(s.get(JobRow, job_id), job_id)
            row.handle, row.started_at = handle, utcnow()
            move(s, row, JobState.RUNNING, f"attempt {plan.attempt}", data={"handle": handle})

    def _slots(self, placement: Placement, used: dict[str, set[int]]) -> list[NodeSlots]:
        """The GPUs of a placement: a share's or MIG job's as placed; whole GPUs the first of the node's
        (healthy, not in MIG mode) that nothing in ``used`` holds, as the share model counts them."""
        if placement.parts:
            return self._share_slots(placement)
        slots = []
        for idx, count in placement.nodes:
            node = self.nodes[idx]
            taken = used.get(node.name, set())
            free = [g for g in node.whole_gpus if g not in taken][:count]
            slots.append(NodeSlots(node.name, tuple(free), placement.cpus if count == 0 else 0))
        return slots

    def _share_slots(self, placement: Placement) -> list[NodeSlots]:
        """The slots of a share or MIG placement: its GPU (or slices) as the share model placed it."""
        p = placement.parts[0]
        node = self.nodes[p.node]
        if p.mig_uuid:
            gpus = tuple(sorted({q.gpu for q in placement.parts}))
            return [NodeSlots(node.name, gpus, 0, mig=tuple(q.mig_uuid for q in placement.parts))]
        uuid = node.gpu_uuids[p.gpu] if p.gpu < len(node.gpu_uuids) else ""
        return [NodeSlots(node.name, (p.gpu,), 0, share=p.fraction, memory_gb=p.memory_gb, uuid=uuid)]


def _row(row: JobRow | None, job_id: int) -> JobRow:
    if row is None:
        raise NotFoundError(f"job {job_id} does not exist")
    return row


def _parts_on(placement: Placement, slot: NodeSlots) -> list[Any]:
    """The share/MIG parts of a placement that a slot carries."""
    if slot.mig:
        return [p for p in placement.parts if p.mig_uuid in slot.mig]
    return list(placement.parts[:1]) if slot.share is not None else []
