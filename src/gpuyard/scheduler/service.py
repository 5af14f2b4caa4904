"""The job service: submit, cancel and inspect jobs, and the scheduling loop, all over the state store.

Every state change is one transaction that also writes a job event, so the store is the only truth:
a server killed at any moment restarts from it (``recover``), adopts the jobs still running (their
pid and exit files outlive it) and requeues those whose launch it never saw.

Only the holder of the store's scheduler lease (:mod:`gpuyard.scheduler.lease`) schedules, reaps and
recovers; any service may submit, cancel and read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError as DuplicateRow
from sqlalchemy.orm import Session

from gpuyard import exitcodes, privileged
from gpuyard.auth import TOKEN_ENV, create_job_token
from gpuyard.errors import CapacityError, ConfigError, ConflictError, NotFoundError, StoreError
from gpuyard.scheduler.elastic import (
    TRAIN_SPEC_CAP,
    ElasticConfig,
    ElasticJob,
    TrainSizes,
    allowed_sizes,
    largest_fit,
    plan_grows,
    plan_shrinks,
)
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.executors.base import Executor, ExecutorUnreachable, ExitStatus, NodeSlots
from gpuyard.scheduler.fabric_placement import (
    DEFAULT_MAX_WAIT_S,
    FabricPlacer,
    check_workload,
    choose,
    workload_of,
)
from gpuyard.scheduler.lease import DEFAULT_TTL_S, SchedulerLease, lease_conflict
from gpuyard.scheduler.nodes import NodeHealthMonitor, NodeStates, preemptible
from gpuyard.scheduler.placement import (
    ClusterState,
    NodeSpec,
    Placement,
    place,
    record_part,
    share_never_fits,
    share_of,
    why_waiting,
)
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob
from gpuyard.scheduler.records import ACTIVE, job_doc, move
from gpuyard.scheduler.spec import JobSpec, JobState, WorkloadSpec
from gpuyard.settings import SERVER_ENV, load_settings
from gpuyard.store.base import utcnow
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow, JobRow

log = logging.getLogger(__name__)

# Below this many free bytes a filesystem counts as full (a few pages: SQLite and small files fail).
FULL_BELOW_BYTES = 1 << 20
# Submissions are refused (507) below this much free space where the store and the jobs' files live.
MIN_FREE_TO_SUBMIT = 16 << 20


class DiskFullError(StoreError):
    """The disk that holds the state store or the jobs' files is (nearly) full: HTTP 507."""

    http_status = 507


# Jobs one team may have waiting (queued or preempted) at once (gpuyard server --max-queued-per-team).
DEFAULT_MAX_QUEUED_PER_TEAM = 10_000


class QueueFullError(CapacityError):
    """A team already has its most jobs waiting: HTTP 429 (the others' submissions are not affected)."""

    http_status = 429


@dataclass(frozen=True)
class ServiceConfig:
    """How the server schedules.

    Attributes:
        policy: policy name (see ``gpuyard.scheduler.policies.POLICIES``; no oracle here).
        teams: known teams and their fair-share weights; jobs of other teams are refused.
        grace_s: after SIGTERM (cancel, preemption) a job has this long to checkpoint before SIGKILL.
        tick_s: the loop runs at least this often (and at once after a submit or cancel).
        min_run_s: a job keeps its GPUs at least this long before a preemptive policy may take them.
        lease_ttl_s: the scheduler lease lapses this long after its holder last renewed it.
        placement: "topology" (heuristics only) or "fabric" (jobs with a workload are placed by predicted
            step time: spread now or wait for a consolidated placement; needs the fabric cluster).
        max_wait_s: under fabric placement, the longest a job waits for a consolidated placement.
        elastic: how elastic jobs (``gpus: {min, max}``) grow and shrink (:mod:`.elastic`).
    """

    policy: str = "fifo"
    teams: dict[str, float] = field(default_factory=lambda: {"default": 1.0})
    grace_s: float = 10.0
    tick_s: float = 0.2
    min_run_s: float = 300.0
    lease_ttl_s: float = DEFAULT_TTL_S
    placement: str = "topology"
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    elastic: ElasticConfig = field(default_factory=ElasticConfig)


class JobService:
    """Jobs on one cluster view, one policy and one executor, recorded in ``store``.

    ``role`` (``server`` or ``in-process``) is recorded with the scheduler lease and shown to a
    service that is refused it.
    """

    def __init__(
        self,
        store: Store,
        nodes: list[NodeSpec],
        executor: Executor,
        config: ServiceConfig,
        role: str = "in-process",
        fabric: Any = None,
    ) -> None:
        self.store, self.nodes, self.executor, self.config = store, nodes, executor, config
        self.lease = SchedulerLease(store, role=role, ttl_s=config.lease_ttl_s)
        self._lease_note: str | None = None  # the other holder this service said it yields to
        self._lease_renewed_at: float | None = None  # monotonic time of this service's last renewal
        # When the scheduler first saw each running job's process gone: its end when the executor
        # knows none and recording it had to wait (a full disk, a database outage).
        self._ended_seen: dict[int, tuple[Any, str | None]] = {}  # job -> (seen at, full disk)
        # Stops requested in the transaction now open, sent once it has committed (_stop_after).
        self._stops: list[tuple[int, dict[str, Any]]] = []
        # The API's URL when a `gpuyard server` runs this service: its jobs then get a job-scoped token.
        self.api_url: str | None = None
        # Each team's share of GPUYARD_HOME's disk (gpuyard.scheduler.diskshare.enable; None: not kept).
        self.disk: Any = None
        # Jobs one team may have waiting at once (None: no bound): one team's flood of submissions
        # neither grows the queue every tick walks without end nor crowds the others out of it.
        self.max_queued_per_team: int | None = DEFAULT_MAX_QUEUED_PER_TEAM
        if config.placement not in ("topology", "fabric"):
            raise ConfigError(f"placement {config.placement!r} is unknown; choose topology or fabric")
        if config.placement == "fabric" and fabric is None:
            raise ConfigError(
                "fabric placement needs the fabric cluster of the nodes (--cluster PRESET|FILE)"
            )
        self.placer = FabricPlacer(fabric, config.max_wait_s) if config.placement == "fabric" else None
        self._workloads: dict[int, Any] = {}
        self.policy = make_policy(
            config.policy,
            weights=config.teams,
            allow_oracle=False,
            min_run_s=config.min_run_s,
            placer=self.placer,
        )
        self.state = ClusterState(nodes)
        self._node_index = {n.name: i for i, n in enumerate(nodes)}
        self.estimator = RuntimeEstimator()
        self._lock = threading.RLock()
        self.wake = threading.Event()
        # Node health: drained nodes get nothing new; ``health`` (set by the server) checks this node.
        self.node_states = NodeStates(store)
        self.health: NodeHealthMonitor | None = None
        self._wait_notes: dict[tuple[int, float], str] = {}  # (job, queued at) -> why it waits, as written
        self._sizes: dict[int, tuple[int, ...]] = {}  # elastic job -> its allowed sizes (read once)
        # The sizes a training job's spec can run at (set by the front end: gpuyard.train.resize);
        # None: every size of an elastic job's range (the trainer checks when it starts).
        self.train_sizes: TrainSizes | None = None
        self._learn_history()

    # -- requests ---------------------------------------------------------------------------------

    def check(self, spec: JobSpec) -> None:
        """Refuse a job that can never run here: unknown team, GPU type or more than the cluster has.

        Raises:
            ConfigError: unknown team.
            CapacityError: the request exceeds what the cluster could ever give one job (says why).
        """
        if spec.team not in self.config.teams:
            known = ", ".join(sorted(self.config.teams))
            raise ConfigError(f"team: {spec.team!r} is unknown; known teams: {known} (server option --team)")
        if spec.time_limit_min and not getattr(self.executor, "time_limits", False):
            raise ConfigError(
                f"time_limit_min: {spec.time_limit_min} is enforced on a Slurm cluster only "
                f"(gpuyard server --slurm); this server's executor is {self.executor.name}"
            )
        isolation = getattr(self.executor, "isolation", None)
        if isolation is not None:
            isolation.for_job(spec.team, spec.user)  # a --job-user template names an existing Unix user
        res = spec.resources
        if res.shared:  # part of one GPU or MIG slices (docs/scheduler.md, sharing)
            share = share_of(res.model_dump())
            why = share_never_fits(self.state, share, res.gpu_type) if share else None
            if self.executor.name in ("ray", "slurm"):
                on = "Ray" if self.executor.name == "ray" else "Slurm (use its shard or MIG GRES)"
                why = f"resources: shares and MIG slices run on the local executor, not on {on}"
            if why:
                raise CapacityError(why)
            return
        if spec.workload is not None:
            self._check_workload(spec)
        if res.elastic:
            # A training job's batch must split at some size: its train spec is read as the job's user.
            allowed_sizes(spec, self.train_sizes, self._reader(spec))
        if res.gpus == 0:
            most = int(self.state.cpu_capacity.max()) if self.nodes else 0
            if res.cpus > most:
                raise CapacityError(
                    f"resources.cpus: {res.cpus} CPU slots asked, the largest node has {most}"
                )
            return
        types = sorted(t for t in self.state.types if t)
        if res.gpu_type and res.gpu_type not in types:
            raise CapacityError(
                f"resources.gpu_type: no node has {res.gpu_type!r}; GPU types here: {types or 'none'}"
            )
        most = self.state.max_gpus(res.gpu_type, self.executor.multi_node)
        if res.gpus > most:
            where = (
                "one node (the local executor does not span nodes)"
                if not self.executor.multi_node
                else "the cluster"
            )
            raise CapacityError(
                f"resources.gpus: {res.gpus} GPUs asked, but {where} has at most {most} healthy"
                f"{' ' + res.gpu_type if res.gpu_type else ''} GPUs: it could never start"
            )

    def _reader(self, spec: JobSpec) -> Any:
        """How the server reads a file a job's spec names: as the job's Unix user when jobs run as
        other users (the server learns only what the job could read itself), at most
        TRAIN_SPEC_CAP bytes of a regular file, never following into a FIFO or a device."""
        isolation = getattr(self.executor, "isolation", None)
        who = isolation.for_job(spec.team, spec.user) if isolation is not None else None
        uid, gid = (who.uid, who.gid) if who is not None and who.switch else (None, None)
        return lambda path: privileged.read_as(uid, gid, path, TRAIN_SPEC_CAP)

    def check_disk(self) -> None:
        """Refuse new work while the disk of the state store or of GPUYARD_HOME (the jobs' logs and exit
        files) is nearly full: what room is left goes to recording the jobs already placed.

        Raises:
            DiskFullError: less than ``MIN_FREE_TO_SUBMIT`` free there (names the folder and its room).
        """
        for folder in self._disk_folders():
            free = free_bytes(folder)
            if free is not None and free < MIN_FREE_TO_SUBMIT:
                raise DiskFullError(
                    f"disk full: {free / 2**20:.1f} MiB free on the disk of {folder} (new jobs need "
                    f"{MIN_FREE_TO_SUBMIT / 2**20:.0f} MiB there); jobs already placed go on; "
                    "free space there and resubmit"
                )

    def check_queue(self, team: str) -> None:
        """Refuse a submission of ``team`` while it has ``max_queued_per_team`` jobs waiting.

        Raises:
            QueueFullError: the team's waiting jobs are at the bound (names it and the option).
        """
        cap = self.max_queued_per_team
        if cap is None:
            return
        waiting = (JobState.QUEUED.value, JobState.PREEMPTED.value)
        with self.store.read() as s:
            n = s.scalar(
                select(func.count()).select_from(JobRow).where(JobRow.team == team, JobRow.state.in_(waiting))
            )
        if n is not None and n >= cap:
            raise QueueFullError(
                f"team {team} has {n} jobs waiting, at most {cap} (gpuyard server --max-queued-per-team); "
                "submit more once some have started, or cancel some"
            )

    def _disk_folders(self) -> list[str]:
        folders = []
        database = self.store.engine.url.database if self.store.is_sqlite else None
        if database and database != ":memory:":
            folders.append(os.path.dirname(os.path.abspath(database)))
        home = str(load_settings().home)
        if home not in folders and os.path.isdir(home):
            folders.append(home)
        return folders

    def _check_workload(self, spec: JobSpec) -> Any:
        """The job's fabric workload, checked (fabric placement: costed on its consolidated placement)."""
        if spec.workload is None:
            return None
        return check_workload(
            spec.workload, spec.resources.gpus, spec.resources.gpu_type, self.state, self.placer
        )

    def submit(self, spec: JobSpec, idempotency_key: str | None = None) -> dict[str, Any]:
        """Queue a job after :meth:`check`; returns its document (see :meth:`submit_once` for the key)."""
        return self.submit_once(spec, idempotency_key)[0]

    def submit_once(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[dict[str, Any], bool]:
        """Queue a job; with ``idempotency_key``, only the first submission with that key queues one.

        A later submission with the same key and the same spec gets the first job back, whatever its
        state (a client whose connection dropped retries safely); two at once queue one job between them.

        Returns:
            The job's document, and True when this call queued it.

        Raises:
            ConfigError: the key was used before with another spec.
        """
        if idempotency_key is not None and (first := self._by_key(spec, idempotency_key)) is not None:
            return first, False
        self.check(spec)
        self.check_disk()
        self.check_queue(spec.team)
        try:
            doc = self._insert(spec, idempotency_key)
        except DuplicateRow:
            # A concurrent submission with the same key inserted first: its job is the answer.
            first = self._by_key(spec, idempotency_key) if idempotency_key is not None else None
            if first is None:
                raise
            return first, False
        self.wake.set()
        return doc, True

    def _by_key(self, spec: JobSpec, key: str) -> dict[str, Any] | None:
        with self.store.read() as s:
            row = s.scalars(select(JobRow).where(JobRow.idempotency_key == key)).first()
            if row is None:
                return None
            if row.spec != spec.model_dump(mode="json"):
                raise ConfigError(
                    f"Idempotency-Key: already used for job {row.id} with a different spec; "
                    "a new job needs a new key"
                )
            return job_doc(row)

    def _insert(self, spec: JobSpec, idempotency_key: str | None) -> dict[str, Any]:
        with self.store.session() as s:
            row = JobRow(
                idempotency_key=idempotency_key,
                name=spec.name,
                team=spec.team,
                user=spec.user,
                priority=spec.priority,
                gpus=spec.resources.gpus,
                spec=spec.model_dump(mode="json"),
                state=JobState.QUEUED.value,
                attempts=0,
                failures=0,
                preemptions=0,
                attained_s=0.0,
                killed=False,
            )
            s.add(row)
            s.flush()
            s.add(
                JobEventRow(
                    job_id=row.id, from_state=None, to_state=JobState.QUEUED.value, reason="submitted"
                )
            )
            return job_doc(row)

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel a job: at once when queued; a running one gets SIGTERM, then SIGKILL after the grace."""
        with self._lock, self._stop_after() as s:
            row = self._row(s, job_id)
            if JobState(row.state).terminal:
                raise ConflictError(f"job {job_id} is already {row.state}")
            if row.state in (JobState.QUEUED.value, JobState.PREEMPTED.value):
                move(s, row, JobState.CANCELLED, "cancelled by user")
            else:
                self._request_stop(row, "cancel")
            doc = job_doc(row)
        self.wake.set()
        return doc

    def get(self, job_id: int) -> dict[str, Any]:
        """One job's document."""
        with self.store.read() as s:
            return job_doc(self._row(s, job_id))

    def list_jobs(
        self, state: str | None = None, team: str | None = None, limit: int = 200
    ) -> list[dict[str, Any]]:
        """Jobs, newest first, optionally of one state or team."""
        q = select(JobRow).order_by(JobRow.id.desc()).limit(limit)
        if state:
            q = q.where(JobRow.state == state)
        if team:
            q = q.where(JobRow.team == team)
        with self.store.read() as s:
            return [job_doc(r) for r in s.scalars(q)]

    def events(self, job_id: int) -> list[dict[str, Any]]:
        """A job's state changes, oldest first."""
        with self.store.read() as s:
            self._row(s, job_id)
            rows = s.scalars(select(JobEventRow).where(JobEventRow.job_id == job_id).order_by(JobEventRow.id))
            return [
                {
                    "at": e.at.isoformat(),
                    "from": e.from_state,
                    "to": e.to_state,
                    "reason": e.reason,
                    "data": e.data,
                }
                for e in rows
            ]

    def read_log(self, job_id: int, offset: int = 0, limit: int = 1 << 16) -> dict[str, Any]:
        """Up to ``limit`` bytes of a job's log from ``offset``; ``done`` once the job is over and read."""
        with self.store.read() as s:
            row = self._row(s, job_id)
            doc = job_doc(row)
        data = b""
        if doc["log_path"]:
            base, rel, owners = self._log_location(doc)
            try:
                data = privileged.read_beneath(base, rel, owners, offset, limit)
            except FileNotFoundError:
                pass
            except PermissionError as exc:
                raise ConflictError(f"job {job_id}'s log: {exc}") from None
        done = JobState(doc["state"]).terminal and len(data) < limit
        return {
            "text": data.decode("utf-8", "replace"),
            "offset": offset + len(data),
            "done": done,
            "state": doc["state"],
        }

    def _log_location(self, doc: dict[str, Any]) -> tuple[str, str, set[int]]:
        """Where a job's log is read from, as the server never opens what a job controls: the folder
        of the server's own it lies under, the path below it (opened without following a link), and
        whose file it must be. A log in the job's own folder (Slurm, as the job's user: slurmd writes
        it) must be the job user's; one in the server's folder (the shim writes it) the server's."""
        path = os.path.abspath(doc["log_path"])
        isolation = getattr(self.executor, "isolation", None)
        job_root = str(isolation.work_root) if isolation is not None else None
        for root in (job_root, str(getattr(self.executor, "jobs_dir", "") or "") or None):
            if root and path.startswith(os.path.abspath(root) + os.sep):
                rel = os.path.relpath(path, root)
                if root == job_root and isolation is not None:
                    try:
                        return root, rel, {isolation.for_job(doc["team"], doc["user"]).uid}
                    except ConfigError as exc:  # its Unix user is gone: whose the file is is unknown
                        raise ConflictError(f"job {doc['id']}'s log: {exc}") from None
                return root, rel, {os.geteuid()}
        return os.path.dirname(path), os.path.basename(path), {os.geteuid()}

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
            from gpuyard.train.straggler import measured

            waits = measured("link", float(report["slowdown"]))
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
                self._request_stop(row, "straggler")
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
        parts = (row.placement or {}).get("nodes", [])
        if node not in {p["node"] for p in parts} or node not in self._node_index:
            return False, f"not restarted: node {node} is not one of the job's"
        self._refresh_state(s)
        work = self.state.copy()
        work.release(self._running(row).placement)
        avoid = {self._node_index[n] for n in (row.avoid_nodes or []) if n in self._node_index}
        work.drain_more(avoid | {self._node_index[node]})
        res = row.spec.get("resources", {})
        need = self._job_sizes(row)[0] if res.get("gpus_max") else row.gpus  # elastic: its smallest size
        if place(work, need, res.get("gpu_type"), int(res.get("cpus", 1)), self.executor.multi_node) is None:
            return False, f"not restarted: no placement of {need} GPUs without node {node} is free now"
        return True, f"restarting without node {node} (checkpoint, requeue)"

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """What launching ``spec`` would do now: checks, placement on the current free GPUs, launch plan."""
        self.check(spec)
        with self._lock:
            with self.store.read() as s:
                self._refresh_state(s)
                active = list(s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE))))
            res = spec.resources
            share = share_of(res.model_dump())
            p = place(self.state, res.gpus, res.gpu_type, res.cpus, self.executor.multi_node, share=share)
            if p is None:
                return {"fits_now": False, "placement": None, "plan": None}
            fabric: dict[str, Any] | None = None
            if self.placer is not None and spec.workload is not None and res.gpus:
                now = time.time()
                job = QueuedJob(
                    id=0,
                    gpus=res.gpus,
                    team=spec.team,
                    user=spec.user,
                    estimate=self.estimator.estimate(spec.team, spec.user, res.gpus),
                    gpu_type=res.gpu_type,
                    enqueued_at=now,
                )
                running = [self._running(r) for r in active if r.placement]
                choice = choose(self.placer, self.state, job, self._check_workload(spec), p, running, now)
                p, fabric = choice.placement, choice.to_dict()
        slots = self._slots(p, self._used_indices())
        plan = self.executor.plan(0, spec, slots, 1)
        doc: dict[str, Any] = {"fits_now": True, "placement": p.how, "plan": plan.to_dict()}
        if fabric is not None:
            doc["fabric"] = fabric
        return doc

    # -- the loop ---------------------------------------------------------------------------------

    def claim(self) -> None:
        """Take the store's scheduler lease (or renew it), or say who holds it.

        Raises:
            ConflictError: another live job service schedules this store; the message names it.
        """
        other = self.lease.acquire()
        if other is not None:
            raise lease_conflict(self.store, self.lease.role, other)

    def holds_lease(self) -> bool:
        """Whether this service is the store's scheduler now (renewing the lease when due).

        While the store refuses the renewal (a full disk, a database restart) the service goes on
        scheduling for as long as its last renewal lasts (its running jobs are still reaped, its stop
        deadlines kept); past that the store's error is raised.
        """
        if self.lease.renew_due():
            try:
                other = self.lease.acquire()
            except StoreError:
                renewed = self._lease_renewed_at
                if self.lease.held and renewed is not None and time.monotonic() - renewed < self.lease.ttl_s:
                    return True
                raise
            if other is None:
                self._lease_note, self._lease_renewed_at = None, time.monotonic()
            elif other.holder != self._lease_note:
                # Said once per holder: the holder's message names its lease's expiry, which moves on
                # every renewal, so the message itself is no key.
                log.warning("not scheduling: %s", lease_conflict(self.store, self.lease.role, other))
                self._lease_note = other.holder
        return self.lease.held

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set (the server's scheduling thread); then give the lease up."""
        errors = TickErrors()
        try:
            while not stop.is_set():
                try:
                    self.tick()
                    errors.succeeded()
                except Exception as exc:  # the loop must outlive a bad tick; the error is logged once
                    errors.failed(exc)
                self.wake.wait(errors.delay(self.config.tick_s))
                self.wake.clear()
        finally:
            with self._lock:
                self.lease.release()

    def tick(self) -> None:
        """Reap ended jobs, enforce stop deadlines, then let the policy start and preempt jobs.

        Does nothing unless this service holds the scheduler lease (taken here when free or stale).
        """
        with self._lock:
            if not self.holds_lease():
                return
            self._reap()
            if self.disk is not None:
                self.disk.maybe_refresh(self.store)  # teams' disk use, log allowances, cut events
            self._apply_node_health()
            self._schedule()

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

    def _apply_node_health(self) -> None:
        """Start a due health check; keep drained nodes out of placement and move preemptible jobs off."""
        if self.health is not None:  # the busy GPUs of every node: a Ray cluster's monitor checks them all
            self.health.maybe_check_nodes(self._used_indices())
        drained = self.node_states.drained() & set(self._node_index)
        self.state.set_drained({self._node_index[n] for n in drained})
        if not drained:
            return
        with self._stop_after() as s:
            for row in s.scalars(select(JobRow).where(JobRow.state == JobState.RUNNING.value)):
                on = sorted(drained & {p["node"] for p in (row.placement or {}).get("nodes", [])})
                if not on or row.stop_requested or not preemptible(row.spec):
                    continue
                self._request_stop(row, "preempt")
                why = f"node {', '.join(on)} drained: preempted to move off it"
                s.add(JobEventRow(job_id=row.id, from_state=row.state, to_state=row.state, reason=why))

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
                    try:
                        self.executor.stop(handle, kill=True)
                    except ExecutorUnreachable as exc:  # tried again next tick
                        log.warning("job %d: SIGKILL not delivered: %s", job_id, exc)
                        continue
                    with self.store.session() as s:
                        row = s.get(JobRow, job_id)
                        if row is None or row.state != JobState.RUNNING.value or row.attempts != attempt:
                            continue
                        row.killed = True
                        s.add(
                            JobEventRow(
                                job_id=row.id,
                                from_state=row.state,
                                to_state=row.state,
                                reason=f"no exit {self.config.grace_s:g} s after SIGTERM: SIGKILL",
                            )
                        )
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

    def _finish(self, s: Session, row: JobRow, status: ExitStatus, full_disk: str | None = None) -> None:
        """Record how a job's attempt ended (``full_disk``: the folder whose full disk kept its exit
        code from being written, when that is why there is none)."""
        # The executor's end time when it has one (a job that ended while no server ran), never
        # before the start nor after now.
        end = min(status.ended_at, utcnow()) if status.ended_at else utcnow()
        end = max(end, row.started_at) if row.started_at else end
        ran = max(0.0, (end - row.started_at).total_seconds()) if row.started_at else 0.0
        request = row.stop_requested
        row.exit_code, row.attained_s = status.code, row.attained_s + ran
        # The placement stays on record (where it last ran); only scheduled/running ones hold GPUs.
        row.stop_requested, row.stop_deadline, row.killed, row.handle = None, None, False, None
        how = status.describe()
        for note in status.notes:  # what else the executor saw (a log cut at its cap)
            s.add(JobEventRow(job_id=row.id, from_state=row.state, to_state=row.state, reason=note))
        if full_disk is not None:
            # Gone without an exit code, though gpuyard sent no SIGKILL, and the exit file could not
            # be written: say so rather than blame a signal it never got.
            how = f"ended, exit code not recorded: the disk at {full_disk} was full"
        if request == "cancel":
            # Like Slurm: a job stopped on request is cancelled, even when it exits cleanly on SIGTERM
            # (a model server does); its run time is not a sample of how long such jobs take.
            move(s, row, JobState.CANCELLED, f"cancelled by user ({how})", at=end)
        elif status.code == 0:
            move(s, row, JobState.SUCCEEDED, "exit code 0", at=end)
            self.estimator.observe(row.team, row.user, row.gpus, row.attained_s)
        elif request == "straggler":
            move(s, row, JobState.PREEMPTED, f"stopped to move off a straggler's node ({how})", at=end)
            avoid = ", ".join(row.avoid_nodes or [])
            move(s, row, JobState.QUEUED, f"requeued to run without node {avoid}; resumes", at=end)
        elif request == "resize" and row.resize_to:
            why = f"resized ({how}): restarts on {row.resize_to} GPUs instead of {row.gpus}"
            move(s, row, JobState.PREEMPTED, why, at=end)
            move(s, row, JobState.QUEUED, "requeued to resize; resumes from its checkpoint", at=end)
        elif request == "preempt" or status.preempted:
            row.preemptions += 1
            move(s, row, JobState.PREEMPTED, f"preempted ({how}); resumes from its checkpoint", at=end)
            move(s, row, JobState.QUEUED, "requeued after preemption", at=end)
        elif status.untraced:  # the executor has no trace of its end: it may have finished
            move(s, row, JobState.FAILED, f"{how}; not run again: it may have finished", at=end)
        elif status.lost:
            move(s, row, JobState.QUEUED, f"process {how}; requeued", at=end)
        else:
            row.failures += 1
            max_restarts = int(row.spec.get("max_restarts", 0))
            ended = "ended" if status.cancelled else "failed"
            if status.code == exitcodes.UNRECOVERABLE:  # a restart would fail the same way (disk full)
                move(s, row, JobState.FAILED, f"failed ({how}: unrecoverable, not restarted)", at=end)
            elif row.failures <= max_restarts:
                why = f"{ended} ({how}); restart {row.failures} of {max_restarts}"
                move(s, row, JobState.QUEUED, why, at=end)
            elif status.cancelled:  # by someone outside gpuyard (an admin's scancel)
                move(s, row, JobState.CANCELLED, how, at=end)
            else:
                move(s, row, JobState.FAILED, f"failed ({how})", at=end)
        if request != "resize":
            row.resize_to = None
        if row.spec.get("resources", {}).get("gpus_max"):
            if row.state == JobState.QUEUED.value:
                row.gpus = self._job_sizes(row)[0]  # an elastic job queues at its smallest size
            elif JobState(row.state).terminal:
                self._sizes.pop(row.id, None)

    def _request_stop(self, row: JobRow, why: str) -> None:
        if row.stop_requested:
            return
        row.stop_requested = why
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

    def _schedule(self) -> None:
        if self.executor.unavailable() is not None:
            return  # nothing starts or is preempted while the executor's controller does not answer
        with self.store.read() as s:
            self._refresh_state(s)
            queued = list(s.scalars(select(JobRow).where(JobRow.state == JobState.QUEUED.value)))
            active = list(s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE))))
        if not queued:
            self._grow(active)
            return
        now = time.time()
        queue = JobQueue(self.policy.key)
        for row in queued:
            queue.add(self._queued(row))
        # Share and MIG jobs hold no whole GPU: policies neither count nor preempt them.
        running = [self._running(r) for r in active if r.placement and not share_of(r.spec.get("resources"))]
        decision = self.policy.decide(self.state, queue, running, now, multi_node=self.executor.multi_node)
        if decision.preempt:
            with self._stop_after() as s:
                for jid in decision.preempt:
                    row = self._row(s, jid)
                    if row.state == JobState.RUNNING.value:
                        self._request_stop(row, "preempt")
                        s.add(
                            JobEventRow(
                                job_id=jid,
                                from_state=row.state,
                                to_state=row.state,
                                reason=f"preemption requested by policy {self.policy.name}",
                            )
                        )
        if decision.waits:
            self._note_waits(decision.waits)
        starts = self._elastic_starts(decision.starts, queued)
        self._note_waiting(queue, starts, decision.waits)
        first = next(queue.ordered())
        if first.id not in {j.id for j, _ in starts} | set(decision.waits) and not decision.preempt:
            self._shrink_for(first, active, starts)
        used, fresh = self._used_indices(), dict[tuple[int, int], int]()
        for qjob, placement in starts:
            slots = self._slots(placement, used, fresh)
            for sl in slots:
                used.setdefault(sl.node, set()).update(sl.gpus)
            self._start(qjob.id, placement, slots)

    def _note_waits(self, waits: dict[int, str]) -> None:
        """Record why fabric placement keeps jobs waiting: an event when the reason changes, not per tick."""
        with self.store.session() as s:
            for jid, note in waits.items():
                row = s.get(JobRow, jid)
                if row is None or row.state != JobState.QUEUED.value or row.reason == note:
                    continue
                row.reason = note
                s.add(JobEventRow(job_id=jid, from_state=row.state, to_state=row.state, reason=note))

    def _note_waiting(
        self, queue: JobQueue, starts: list[tuple[QueuedJob, Placement]], waits: dict[int, str]
    ) -> None:
        """Say why each job left queued waits (the job's reason, no event: it changes as GPUs free up)."""
        work = self.state.copy()
        for _, placement in starts:
            work.take(placement)
        started = {j.id for j, _ in starts} | set(waits)
        notes, seen = {}, {}
        for j in queue.ordered():
            if j.id in started:
                continue
            note = why_waiting(work, j.gpus, j.gpu_type, j.share, j.cpus, self.executor.multi_node)
            seen[(j.id, j.enqueued_at)] = note
            if self._wait_notes.get((j.id, j.enqueued_at)) != note:  # (re)queued or changed: write it
                notes[j.id] = note
        self._wait_notes = seen
        if not notes:
            return
        with self.store.session() as s:
            for row in s.scalars(select(JobRow).where(JobRow.id.in_(list(notes)))):
                if row.state == JobState.QUEUED.value and row.reason != notes[row.id]:
                    row.reason = notes[row.id]

    # -- elastic jobs (docs/scheduler.md, "Elastic jobs"; the rules in gpuyard.scheduler.elastic) ------

    def _job_sizes(self, row: JobRow) -> tuple[int, ...]:
        """An elastic job's allowed sizes (its minimum alone if its train spec no longer splits)."""
        if row.id not in self._sizes:
            spec = JobSpec.model_validate(row.spec)
            try:
                self._sizes[row.id] = allowed_sizes(spec, self.train_sizes, self._reader(spec))
            except ConfigError as exc:
                log.warning("job %s: runs at its minimum size: %s", row.id, exc)
                self._sizes[row.id] = (spec.resources.gpus,)
        return self._sizes[row.id]

    def _elastic_starts(
        self, starts: list[tuple[QueuedJob, Placement]], queued: list[JobRow]
    ) -> list[tuple[QueuedJob, Placement]]:
        """The policy's starts, with each elastic job grown to its size: the size it was resized to,
        else its maximum when no other job is left waiting, as far as the free GPUs allow."""
        rows = {r.id: r for r in queued}
        if not any(rows[j.id].spec.get("resources", {}).get("gpus_max") for j, _ in starts):
            return starts
        work = self.state.copy()
        for _, placement in starts:
            work.take(placement)
        waiting = len(queued) > len(starts)
        out = []
        for qjob, placement in starts:
            row = rows[qjob.id]
            sizes = self._job_sizes(row) if row.spec.get("resources", {}).get("gpus_max") else ()
            target = row.resize_to or (sizes[-1] if sizes and not waiting else placement.gpus)
            if placement.parts or not placement.gpus or target <= placement.gpus:
                out.append((qjob, placement))
                continue
            work.release(placement)
            fits = [n for n in sizes if placement.gpus <= n <= target]
            drained = work.drained
            work.drain_more(qjob.avoid)  # nodes it must not use (a straggler's): for its placement only
            grown = largest_fit(work, fits, qjob.gpu_type, self.executor.multi_node) or placement
            work.drained = drained
            work.take(grown)
            out.append((qjob, grown))
        return out

    def _elastic_running(self, active: list[JobRow]) -> list[ElasticJob]:
        """The running elastic jobs a resize may touch; none while an earlier resize is stopping one."""
        if not self.config.elastic.enabled or any(r.stop_requested == "resize" for r in active):
            return []
        now, out = time.time(), []
        for row in active:
            res = row.spec.get("resources", {})
            if row.state != JobState.RUNNING.value or row.stop_requested or not res.get("gpus_max"):
                continue
            run = self._running(row)
            # Work left: the estimate from history less what it ran; past that, as long again as it
            # ran (run times are heavy-tailed: a job that outlived its estimate is likely a long one).
            ran = row.attained_s + now - run.started_at
            left = max(self.estimator.estimate(row.team, row.user, row.gpus) - ran, ran)
            out.append(
                ElasticJob(
                    id=row.id,
                    gpus=row.gpus,
                    sizes=self._job_sizes(row),
                    placement=run.placement,
                    started_at=run.started_at,
                    remaining_s=left,
                    gpu_type=res.get("gpu_type"),
                )
            )
        return out

    def _grow(self, active: list[JobRow]) -> None:
        """Nothing waits: grow running elastic jobs into idle GPUs when it pays (``plan_grows``)."""
        jobs = self._elastic_running(active) if self.state.free_gpus > 0 else []
        if jobs:
            plans = plan_grows(self.state, jobs, time.time(), self.config.elastic, self.executor.multi_node)
            self._resize(plans, "grow into idle GPUs")

    def _shrink_for(
        self, first: QueuedJob, active: list[JobRow], starts: list[tuple[QueuedJob, Placement]]
    ) -> None:
        """The first queued job cannot start: shrink running elastic jobs when that lets it start."""
        jobs = self._elastic_running(active) if first.share is None else []
        if jobs:
            after = self.state.copy()  # with this tick's starts taken
            for _, placement in starts:
                after.take(placement)
            plans = plan_shrinks(
                after,
                first.gpus,
                first.gpu_type,
                jobs,
                time.time(),
                self.config.elastic,
                self.executor.multi_node,
            )
            self._resize(plans, f"shrink to let job {first.id} start")

    def _resize(self, plans: list[tuple[int, int]], why: str) -> None:
        """Stop each job as for a preemption, to restart at its new size."""
        if not plans:
            return
        with self._stop_after() as s:
            for jid, size in plans:
                row = self._row(s, jid)
                if row.state != JobState.RUNNING.value or row.stop_requested:
                    continue
                row.resize_to = size
                self._request_stop(row, "resize")
                note = f"{why}: from {row.gpus} to {size} GPUs (checkpoint, then restart at the new size)"
                s.add(JobEventRow(job_id=jid, from_state=row.state, to_state=row.state, reason=note))

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
                row = self._row(s, job_id)
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
                row = self._row(s, job_id)
                row.placement, row.handle = None, None
                move(s, row, JobState.FAILED, f"launch failed: {exc}")
            return
        with self.store.session() as s:
            row = self._row(s, job_id)
            row.handle, row.started_at = handle, utcnow()
            move(s, row, JobState.RUNNING, f"attempt {plan.attempt}", data={"handle": handle})

    # -- helpers ----------------------------------------------------------------------------------

    def _row(self, s: Session, job_id: int) -> JobRow:
        row = s.get(JobRow, job_id)
        if row is None:
            raise NotFoundError(f"job {job_id} does not exist")
        return row

    def _learn_history(self) -> None:
        with self.store.read() as s:
            rows = s.scalars(
                select(JobRow).where(JobRow.state == JobState.SUCCEEDED.value).order_by(JobRow.id)
            )
            for r in rows:
                self.estimator.observe(r.team, r.user, r.gpus, r.attained_s)

    def _refresh_state(self, s: Session) -> None:
        self.state.reset()
        for row in s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE))):
            for part in (row.placement or {}).get("nodes", []):
                i = self._node_index.get(part["node"])
                if i is not None:
                    self.state.hold_record(i, part)

    def _used_indices(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        with self.store.read() as s:
            for row in s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE))):
                for part in (row.placement or {}).get("nodes", []):
                    used.setdefault(part["node"], set()).update(part["gpus"])
        return used

    def _slots(
        self, placement: Placement, used: dict[str, set[int]], fresh: dict[tuple[int, int], int] | None = None
    ) -> list[NodeSlots]:
        if placement.parts:
            return self._share_slots(placement, used, {} if fresh is None else fresh)
        slots = []
        for idx, count in placement.nodes:
            node = self.nodes[idx]
            taken = used.get(node.name, set())
            free = [g for g in node.healthy_gpus if g not in taken][:count]
            slots.append(NodeSlots(node.name, tuple(free), placement.cpus if count == 0 else 0))
        return slots

    def _share_slots(
        self, placement: Placement, used: dict[str, set[int]], fresh: dict[tuple[int, int], int]
    ) -> list[NodeSlots]:
        """The slots of a share or MIG placement; a share on a fresh GPU (negative index) gets the first
        whole free GPU of its node, the same one for every share placed on it in this decision."""
        p = placement.parts[0]
        node = self.nodes[p.node]
        if p.mig_uuid:
            gpus = tuple(sorted({q.gpu for q in placement.parts}))
            return [NodeSlots(node.name, gpus, 0, mig=tuple(q.mig_uuid for q in placement.parts))]
        gpu = p.gpu
        if gpu < 0:
            if (p.node, gpu) not in fresh:
                taken = used.get(node.name, set())
                fresh[(p.node, gpu)] = next(g for g in node.whole_gpus if g not in taken)
            gpu = fresh[(p.node, gpu)]
        uuid = node.gpu_uuids[gpu] if gpu < len(node.gpu_uuids) else ""
        return [NodeSlots(node.name, (gpu,), 0, share=p.fraction, memory_gb=p.memory_gb, uuid=uuid)]

    def _queued(self, row: JobRow) -> QueuedJob:
        res = row.spec.get("resources", {})
        return QueuedJob(
            id=row.id,
            # An elastic job waits for its smallest allowed size (its minimum may not split the batch).
            gpus=self._job_sizes(row)[0] if res.get("gpus_max") else row.gpus,
            team=row.team,
            user=row.user,
            priority=row.priority,
            submit_time=row.submitted_at.timestamp(),
            estimate=self.estimator.estimate(row.team, row.user, row.gpus),
            gpu_type=res.get("gpu_type"),
            cpus=int(res.get("cpus", 1)),
            attained=row.attained_s,
            enqueued_at=row.queued_at.timestamp(),
            workload=self._workload(row),
            share=share_of(res),
            avoid=frozenset(self._node_index[n] for n in row.avoid_nodes or () if n in self._node_index),
        )

    def _workload(self, row: JobRow) -> Any:
        """The fabric workload of a queued job (parsed once per job), None without fabric placement."""
        if self.placer is None or not row.spec.get("workload"):
            return None
        if row.id not in self._workloads:
            try:
                self._workloads[row.id] = workload_of(WorkloadSpec.model_validate(row.spec["workload"]))
            except Exception:  # checked at submit; a spec written by an older version is placed as before
                log.warning("job %s: workload not usable, placed by topology only", row.id, exc_info=True)
                self._workloads[row.id] = None
        return self._workloads[row.id]

    def _running(self, row: JobRow) -> RunningJob:
        parts = (row.placement or {}).get("nodes", [])
        nodes = tuple((self._node_index.get(p["node"], 0), len(p["gpus"])) for p in parts)
        started = (row.started_at or utcnow()).timestamp()
        estimate = self.estimator.estimate(row.team, row.user, row.gpus)
        return RunningJob(
            id=row.id,
            gpus=row.gpus,
            team=row.team,
            priority=row.priority,
            started_at=started,
            expected_end=started + max(estimate - row.attained_s, 1.0),
            placement=Placement(nodes, "running"),
            gpu_type=row.spec.get("resources", {}).get("gpu_type"),
            stopping=bool(row.stop_requested),
            attained=row.attained_s,
        )


def _parts_on(placement: Placement, slot: NodeSlots) -> list[Any]:
    """The share/MIG parts of a placement that a slot carries (with the slot's real GPU index)."""
    if slot.mig:
        return [p for p in placement.parts if p.mig_uuid in slot.mig]
    if slot.share is not None and placement.parts:
        return [replace(placement.parts[0], gpu=slot.gpus[0])]
    return []


def active_gpus(docs: Iterable[dict[str, Any]]) -> int:
    """GPUs held by the jobs among ``docs`` that are scheduled or running."""
    return sum(d["gpus"] for d in docs if d["state"] in ACTIVE)


class TickErrors:
    """The scheduling loop's error log: one line per distinct error, its traceback once, with backoff.

    A tick that fails as the previous one did (a database outage, a full disk) is not logged again at
    once: the same error is said again after 10 s, then 20, 40, ... (at most every 10 minutes), with
    how often it happened meanwhile; recovery is one line. While ticks fail, the loop waits longer
    between them (at most ``MAX_DELAY_S``), so a broken store is not hammered five times a second.
    """

    FIRST_REPEAT_S = 10.0
    MAX_REPEAT_S = 600.0
    MAX_DELAY_S = 2.0

    def __init__(self) -> None:
        self.failures = 0  # consecutive failed ticks
        self.since = 0.0  # monotonic time of the first of them
        self._shown: set[str] = set()  # errors whose traceback was logged
        self._key: str | None = None  # the error now repeating
        self._next_at = 0.0
        self._every = self.FIRST_REPEAT_S
        self._repeats = 0

    def failed(self, exc: BaseException) -> None:
        """A tick raised ``exc``."""
        now = time.monotonic()
        if not self.failures:
            self.since = now
        self.failures += 1
        key = f"{type(exc).__name__}: {exc}"
        first_line = key.splitlines()[0] if key else key
        if key != self._key:
            self._key, self._repeats = key, 0
            self._every, self._next_at = self.FIRST_REPEAT_S, now + self.FIRST_REPEAT_S
            if key in self._shown:
                log.error("scheduling tick failed: %s", first_line)
            else:
                if len(self._shown) < 1000:
                    self._shown.add(key)
                log.error("scheduling tick failed: %s", first_line, exc_info=exc)
            return
        self._repeats += 1
        if now >= self._next_at:
            log.error(
                "scheduling tick still failing (%d more times in the last %.0f s): %s",
                self._repeats,
                self._every,
                first_line,
            )
            self._repeats = 0
            self._every = min(self._every * 2, self.MAX_REPEAT_S)
            self._next_at = now + self._every

    def succeeded(self) -> None:
        """A tick went through: say so once when ticks were failing."""
        if self.failures:
            log.warning(
                "scheduling recovered after %d failed ticks over %.1f s",
                self.failures,
                time.monotonic() - self.since,
            )
        self.failures, self._key = 0, None

    def delay(self, tick_s: float) -> float:
        """How long to wait before the next tick: ``tick_s``, doubled per failed tick up to a cap."""
        if not self.failures:
            return tick_s
        return float(max(tick_s, min(tick_s * 2 ** min(self.failures, 16), self.MAX_DELAY_S)))


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
