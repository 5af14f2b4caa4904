"""The job service: submit, cancel and inspect jobs, and the scheduling loop, all over the state store.

Every state change is one transaction that also writes a job event, so the store is the only truth:
a server killed at any moment restarts from it (``recover``), adopts the jobs still running (their
pid and exit files outlive it) and requeues those whose launch it never saw.

Only the holder of the store's scheduler lease (:mod:`gpuyard.scheduler.lease`) schedules, reaps and
recovers; any service may submit, cancel and read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError as DuplicateRow
from sqlalchemy.orm import Session

from gpuyard import privileged
from gpuyard.errors import CapacityError, ConfigError, ConflictError, NotFoundError, StoreError
from gpuyard.scheduler.core import JobView, PlacedPart, SchedulerCore, Stop, StopReason
from gpuyard.scheduler.elastic import TRAIN_SPEC_CAP, ElasticConfig, TrainSizes, allowed_sizes
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.executors.base import Executor
from gpuyard.scheduler.exits import ExitHandling, free_bytes
from gpuyard.scheduler.fabric_placement import (
    DEFAULT_MAX_WAIT_S,
    FabricPlacer,
    check_workload,
    choose,
    workload_of,
)
from gpuyard.scheduler.launching import Launching
from gpuyard.scheduler.lease import DEFAULT_TTL_S, SchedulerLease, lease_conflict
from gpuyard.scheduler.nodes import NodeHealthMonitor, NodeStates
from gpuyard.scheduler.placement import (
    DEFAULT_PACKING,
    ClusterState,
    NodeSpec,
    place,
    share_never_fits,
    share_of,
)
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.queue import QueuedJob
from gpuyard.scheduler.records import ACTIVE, job_doc, move
from gpuyard.scheduler.recovery import Recovery
from gpuyard.scheduler.spec import JobSpec, JobState, WorkloadSpec
from gpuyard.scheduler.stragglers import Stragglers
from gpuyard.settings import load_settings
from gpuyard.store.db import Store
from gpuyard.store.tables.jobs import JobEventRow, JobRow

log = logging.getLogger(__name__)

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
        packing: how GPU shares and MIG slices are placed (``gpuyard.scheduler.packing.PACKING_POLICIES``;
            FGD's task mix is the jobs known now).
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
    packing: str = DEFAULT_PACKING


class JobService(ExitHandling, Recovery, Launching, Stragglers):
    """Jobs on one cluster view, one policy and one executor, recorded in ``store``: a driver of the
    scheduling core (:mod:`gpuyard.scheduler.core`), which decides; this reads the jobs, carries out
    what it decides and records it. Reaping and exit handling, recovery, launching and straggler
    restarts live in :mod:`.exits`, :mod:`.recovery`, :mod:`.launching` and :mod:`.stragglers`.

    ``role`` (``server`` or ``in-process``) is recorded with the scheduler lease and shown to a
    service that is refused it.
    """

    config: ServiceConfig

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
        self._ended_seen: dict[int, tuple[datetime, str | None]] = {}  # job -> (seen at, full disk)
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
        self.state = ClusterState(nodes, self.config.packing)
        self._node_index = {n.name: i for i, n in enumerate(nodes)}
        self.estimator = RuntimeEstimator()
        self._lock = threading.RLock()
        self.wake = threading.Event()
        # Node health: drained nodes get nothing new; ``health`` (set by the server) checks this node.
        self.node_states = NodeStates(store)
        self.health: NodeHealthMonitor | None = None
        self._wait_notes: dict[tuple[int, float], str] = {}  # (job, queued at) -> why it waits, as written
        self._sizes: dict[int, tuple[int, ...]] = {}  # elastic job -> its allowed sizes (read once)
        self._specs: dict[int, JobSpec] = {}  # job -> its spec, parsed once
        # The sizes a training job's spec can run at (set by the front end: gpuyard.train.resize);
        # None: every size of an elastic job's range (the trainer checks when it starts).
        self.train_sizes: TrainSizes | None = None
        self.core = SchedulerCore(nodes, self.policy, self.estimator, config.elastic, executor.multi_node)
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
                self._request_stop(row, StopReason.CANCEL)
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

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        """What launching ``spec`` would do now: checks, placement on the current free GPUs, launch plan."""
        self.check(spec)
        with self._lock:
            with self.store.read() as s:
                views = self._views(s)
            self.core.hold(self.state, views)
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
                running = [self.core.running(v, now) for v in views if v.holds and v.placement]
                choice = choose(self.placer, self.state, job, self._check_workload(spec), p, running, now)
                p, fabric = choice.placement, choice.to_dict()
        slots = self._slots(p, _used(views))
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
            self._check_health()
            self._schedule()

    def _check_health(self) -> None:
        """Start a due health check; keep drained nodes out of placement (the core moves preemptible
        jobs off them)."""
        if self.health is not None:  # the busy GPUs of every node: a Ray cluster's monitor checks them all
            with self.store.read() as s:
                self.health.maybe_check_nodes(_used(self._views(s)))
        drained = self.node_states.drained() & set(self._node_index)
        self.state.set_drained({self._node_index[n] for n in drained})

    def _schedule(self) -> None:
        """One pass of the core over every job not over yet (read in one query), then its plan carried
        out: stops (preemptions, drained nodes, resizes) requested, reasons noted, starts launched.
        While the executor's controller does not answer nothing starts or is preempted."""
        launch = self.executor.unavailable() is None
        with self.store.read() as s:
            views = self._views(s)
        self.core.hold(self.state, views)
        plan = self.core.tick(views, self.state, time.time(), launch=launch)
        self._request_stops(plan.stops)
        if plan.waits:
            self._note_waits(plan.waits)
        self._note_waiting(plan.waiting, views)
        used = _used(views)
        for start in plan.starts:
            slots = self._slots(start.placement, used)
            for sl in slots:
                used.setdefault(sl.node, set()).update(sl.gpus)
            self._start(start.job, start.placement, slots)

    def _request_stops(self, stops: list[Stop]) -> None:
        """Ask the running jobs of ``stops`` to stop, each once, with its reason as an event."""
        if not stops:
            return
        with self._stop_after() as s:
            for stop in stops:
                row = self._row(s, stop.job)
                if row.state != JobState.RUNNING.value or row.stop_requested:
                    continue
                if stop.gpus is not None:
                    row.resize_to = stop.gpus
                self._request_stop(row, stop.reason)
                s.add(JobEventRow(job_id=row.id, from_state=row.state, to_state=row.state, reason=stop.note))

    def _note_waits(self, waits: dict[int, str]) -> None:
        """Record why fabric placement keeps jobs waiting: an event when the reason changes, not per tick."""
        with self.store.session() as s:
            for jid, note in waits.items():
                row = s.get(JobRow, jid)
                if row is None or row.state != JobState.QUEUED.value or row.reason == note:
                    continue
                row.reason = note
                s.add(JobEventRow(job_id=jid, from_state=row.state, to_state=row.state, reason=note))

    def _note_waiting(self, waiting: dict[int, str], views: list[JobView]) -> None:
        """Say why each job left queued waits (the job's reason, no event: it changes as GPUs free up);
        written when it changed or the job was queued again."""
        queued_at = {v.id: v.queued_at for v in views}
        seen, notes = {}, {}
        for jid, note in waiting.items():
            key = (jid, queued_at[jid])
            seen[key] = note
            if self._wait_notes.get(key) != note:
                notes[jid] = note
        self._wait_notes = seen
        if not notes:
            return
        with self.store.session() as s:
            for row in s.scalars(select(JobRow).where(JobRow.id.in_(list(notes)))):
                if row.state == JobState.QUEUED.value and row.reason != notes[row.id]:
                    row.reason = notes[row.id]

    # -- views (built once per row; the core decides on them) --------------------------------------

    def _views(self, s: Session) -> list[JobView]:
        """Every job not over yet (queued, scheduled, running), in one query."""
        live = (JobState.QUEUED.value, *ACTIVE)
        views = [self._view(r) for r in s.scalars(select(JobRow).where(JobRow.state.in_(live)))]
        for gone in self._specs.keys() - {v.id for v in views}:  # over (or cancelled) since: dropped
            self._forget(gone)
        return views

    def _view(self, row: JobRow) -> JobView:
        """The core's view of ``row``; its spec is parsed and its sizes are read once per job."""
        spec = self._specs.get(row.id)
        if spec is None:
            spec = self._specs[row.id] = JobSpec.model_validate(row.spec)
        return JobView(
            id=row.id,
            state=JobState(row.state),
            name=row.name,
            team=row.team,
            user=row.user,
            priority=row.priority,
            gpus=row.gpus,
            spec=spec,
            sizes=self._job_sizes(row.id, spec),
            submitted_at=row.submitted_at.timestamp(),
            queued_at=row.queued_at.timestamp(),
            attempts=row.attempts,
            failures=row.failures,
            preemptions=row.preemptions,
            attained_s=row.attained_s,
            placement=tuple(PlacedPart.of_record(p) for p in (row.placement or {}).get("nodes", [])),
            started_at=row.started_at.timestamp() if row.started_at else None,
            stop=StopReason(row.stop_requested) if row.stop_requested else None,
            killed=row.killed,
            resize_to=row.resize_to,
            avoid_nodes=frozenset(row.avoid_nodes or ()),
            share=share_of(row.spec.get("resources")),
            workload=self._workload(row) if row.state == JobState.QUEUED.value else None,
        )

    def _job_sizes(self, job_id: int, spec: JobSpec) -> tuple[int, ...]:
        """An elastic job's allowed sizes (its minimum alone if its train spec no longer splits); a
        rigid job's own count."""
        if not spec.resources.elastic:
            return (spec.resources.gpus,)
        if job_id not in self._sizes:
            try:
                self._sizes[job_id] = allowed_sizes(spec, self.train_sizes, self._reader(spec))
            except ConfigError as exc:
                log.warning("job %s: runs at its minimum size: %s", job_id, exc)
                self._sizes[job_id] = (spec.resources.gpus,)
        return self._sizes[job_id]

    def _forget(self, job_id: int) -> None:
        """A job is over: drop what was kept of it."""
        for kept in (self._specs, self._sizes, self._workloads):
            kept.pop(job_id, None)

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


def _used(views: Iterable[JobView]) -> dict[str, set[int]]:
    """The GPU indices held on each node by the jobs holding GPUs."""
    used: dict[str, set[int]] = {}
    for v in views:
        if v.holds:
            for part in v.placement:
                used.setdefault(part.node, set()).update(part.gpus)
    return used
