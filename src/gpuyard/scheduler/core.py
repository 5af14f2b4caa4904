"""The scheduling core: what to start, stop and resize now, and what a job's exit means, on plain data.

No database, no processes, no clock read: every input is an argument (the jobs as frozen
:class:`JobView` records or the policy's records, the cluster's free slots, ``now``) and every output
a value (a :class:`Plan`, an :class:`ExitOutcome`). Two drivers carry out what it decides:

* the job service (:mod:`gpuyard.scheduler.service`): reads the views from the store in one query,
  calls :meth:`SchedulerCore.tick`, writes the plan's starts and stops and hands them to its executor;
* the trace simulator (:func:`gpuyard.scheduler.simulator.simulate`): keeps its queue across events,
  calls :meth:`SchedulerCore.decide` on a virtual clock, and runs the plan on a fake executor.

So the policies, placement and elastic rules the simulator measures are the ones the server runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from gpuyard import exitcodes
from gpuyard.scheduler.elastic import ElasticConfig, ElasticJob, largest_fit, plan_grows, plan_shrinks
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.executors.base import ExitStatus
from gpuyard.scheduler.openb import MILLI
from gpuyard.scheduler.placement import ClusterState, GpuShare, NodeSpec, Placement, why_waiting
from gpuyard.scheduler.policies import Policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob
from gpuyard.scheduler.spec import JobSpec, JobState


class StopReason(StrEnum):
    """Why the scheduler asked a running job to stop (SIGTERM, then SIGKILL after the grace period);
    the value is what the store keeps in ``stop_requested``."""

    CANCEL = "cancel"  # the user cancelled: it ends cancelled, whatever its exit
    PREEMPT = "preempt"  # a policy or a drained node takes its GPUs: checkpoint, requeue
    STRAGGLER = "straggler"  # restart without a straggler's node
    RESIZE = "resize"  # an elastic job restarts at another size


@dataclass(frozen=True)
class PlacedPart:
    """One node's part of where a job runs: its GPUs and CPU slots, and for a share its (fraction,
    GiB) of the GPU, for MIG its slices as (gpu, profile, uuid)."""

    node: str
    gpus: tuple[int, ...]
    cpus: int = 0
    share: tuple[float, float] | None = None
    mig: tuple[tuple[int, str, str], ...] = ()

    @classmethod
    def of_record(cls, doc: Mapping[str, Any]) -> PlacedPart:
        """From a placement record's item (``JobRow.placement["nodes"]``, :func:`record_part`)."""
        share = doc.get("share")
        return cls(
            node=str(doc["node"]),
            gpus=tuple(int(g) for g in doc.get("gpus") or ()),
            cpus=int(doc.get("cpus") or 0),
            share=(float(share["fraction"]), float(share.get("memory_gb") or 0.0)) if share else None,
            mig=tuple((int(m["gpu"]), str(m["profile"]), str(m["uuid"])) for m in doc.get("mig") or ()),
        )

    def record(self) -> dict[str, Any]:
        """Back to the record form (what ``ClusterState.hold_record`` holds)."""
        doc: dict[str, Any] = {"node": self.node, "gpus": list(self.gpus), "cpus": self.cpus}
        if self.mig:
            doc["mig"] = [{"gpu": g, "profile": p, "uuid": u} for g, p, u in self.mig]
        elif self.share is not None:
            doc["share"] = {"fraction": self.share[0], "memory_gb": self.share[1]}
        return doc


@dataclass(frozen=True)
class JobView:
    """One job as the core sees it, built once from its stored row (times in seconds since the epoch).

    ``gpus`` is what it holds or asks for now (an elastic job: its current size); ``sizes`` the sizes
    it may run at, ascending (a rigid job: its own count); ``workload`` its parsed fabric workload
    (fabric placement only); ``share`` its part of one GPU or MIG slices (None: whole GPUs).
    """

    id: int
    state: JobState
    name: str
    team: str
    user: str
    priority: int
    gpus: int
    spec: JobSpec
    sizes: tuple[int, ...]
    submitted_at: float
    queued_at: float
    attempts: int = 0
    failures: int = 0
    preemptions: int = 0
    attained_s: float = 0.0
    placement: tuple[PlacedPart, ...] = ()
    started_at: float | None = None
    stop: StopReason | None = None
    killed: bool = False
    resize_to: int | None = None
    avoid_nodes: frozenset[str] = frozenset()
    share: GpuShare | None = None
    workload: Any = None

    @property
    def elastic(self) -> bool:
        """Whether it may run at several sizes (``gpus: {min, max}``)."""
        return self.spec.resources.elastic

    @property
    def holds(self) -> bool:
        """Whether it holds its placement's GPUs (scheduled or running)."""
        return self.state in (JobState.SCHEDULED, JobState.RUNNING)

    @property
    def waiting(self) -> bool:
        """Queued (a preempted job is queued again in the same transaction)."""
        return self.state is JobState.QUEUED

    @property
    def preemptible(self) -> bool:
        """Whether it can be moved off a drained node without losing its work: a ``train`` job (the
        trainer checkpoints on SIGTERM) or one that names a ``checkpoint_dir``."""
        return bool(self.spec.train or self.spec.checkpoint_dir)

    def on_nodes(self) -> set[str]:
        """The nodes it holds something on."""
        return {p.node for p in self.placement}


@dataclass(frozen=True)
class Start:
    """Start a queued job on ``placement``."""

    job: int
    placement: Placement


@dataclass(frozen=True)
class Stop:
    """Ask a running job to stop (``reason``), saying ``note`` in its events; a resize gives ``gpus``,
    the size it restarts at."""

    job: int
    reason: StopReason
    note: str
    gpus: int | None = None


@dataclass(frozen=True)
class Plan:
    """What one tick decided: starts (whole GPUs, shares and MIG slices alike), stops with their
    reasons (preemptions, drained nodes, resizes), and why each job left waiting waits
    (``waits``: fabric placement's notes, recorded as events; ``waiting``: the job's reason only)."""

    starts: list[Start] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    waits: dict[int, str] = field(default_factory=dict)
    waiting: dict[int, str] = field(default_factory=dict)

    @property
    def resizes(self) -> list[Stop]:
        """The stops that are resizes."""
        return [s for s in self.stops if s.reason is StopReason.RESIZE]


# -- exits --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transition:
    """One state change and its reason, as written to the job's events."""

    to: JobState
    reason: str


@dataclass(frozen=True)
class ExitOutcome:
    """What a job's exit means: its state changes in order, its counters after it, and what to keep.

    Attributes:
        transitions: the moves, in order (a preemption: preempted, then queued).
        failures: the job's failure count after this exit.
        preemptions: its preemption count after this exit.
        sample: its run time is a sample of how long such jobs take (it succeeded).
        keep_resize: its ``resize_to`` stays (it restarts at that size).
        gpus: an elastic job queued again waits at this size (its smallest); None: unchanged.
    """

    transitions: tuple[Transition, ...]
    failures: int
    preemptions: int
    sample: bool = False
    keep_resize: bool = False
    gpus: int | None = None

    @property
    def state(self) -> JobState:
        """Where the job ends up."""
        return self.transitions[-1].to


def on_exit(job: JobView, status: ExitStatus, full_disk: str | None = None) -> ExitOutcome:
    """What the end of ``job``'s attempt means, from why it was stopped (if it was) and how it ended.

    ``full_disk``: the folder whose full disk kept the exit code from being written, when that is why
    there is none (then said instead of a signal it never got).
    """
    how = status.describe()
    if full_disk is not None:
        how = f"ended, exit code not recorded: the disk at {full_disk} was full"
    failures, preemptions = job.failures, job.preemptions
    moves: list[Transition]
    Q, P = JobState.QUEUED, JobState.PREEMPTED
    if job.stop is StopReason.CANCEL:
        # Like Slurm: a job stopped on request is cancelled, even when it exits cleanly on SIGTERM
        # (a model server does); its run time is not a sample of how long such jobs take.
        moves = [Transition(JobState.CANCELLED, f"cancelled by user ({how})")]
    elif status.code == 0:
        moves = [Transition(JobState.SUCCEEDED, "exit code 0")]
    elif job.stop is StopReason.STRAGGLER:
        avoid = ", ".join(sorted(job.avoid_nodes))
        moves = [
            Transition(P, f"stopped to move off a straggler's node ({how})"),
            Transition(Q, f"requeued to run without node {avoid}; resumes"),
        ]
    elif job.stop is StopReason.RESIZE and job.resize_to:
        moves = [
            Transition(P, f"resized ({how}): restarts on {job.resize_to} GPUs instead of {job.gpus}"),
            Transition(Q, "requeued to resize; resumes from its checkpoint"),
        ]
    elif job.stop is StopReason.PREEMPT or status.preempted:
        preemptions += 1
        moves = [
            Transition(P, f"preempted ({how}); resumes from its checkpoint"),
            Transition(Q, "requeued after preemption"),
        ]
    elif status.untraced:  # the executor has no trace of its end: it may have finished
        moves = [Transition(JobState.FAILED, f"{how}; not run again: it may have finished")]
    elif status.lost:
        moves = [Transition(Q, f"process {how}; requeued")]
    else:
        failures += 1
        moves = [_failed(job, status, how, failures)]
    state = moves[-1].to
    return ExitOutcome(
        transitions=tuple(moves),
        failures=failures,
        preemptions=preemptions,
        sample=state is JobState.SUCCEEDED,
        keep_resize=job.stop is StopReason.RESIZE,
        gpus=job.sizes[0] if job.elastic and state is Q else None,
    )


def _failed(job: JobView, status: ExitStatus, how: str, failures: int) -> Transition:
    """A failed attempt: run again while its ``max_restarts`` allow, else failed (or cancelled, when
    someone outside gpuyard ended it)."""
    most = job.spec.max_restarts
    ended = "ended" if status.cancelled else "failed"
    if status.code == exitcodes.UNRECOVERABLE:  # a restart would fail the same way (disk full)
        return Transition(JobState.FAILED, f"failed ({how}: unrecoverable, not restarted)")
    if failures <= most:
        return Transition(JobState.QUEUED, f"{ended} ({how}); restart {failures} of {most}")
    if status.cancelled:  # by someone outside gpuyard (an admin's scancel)
        return Transition(JobState.CANCELLED, how)
    return Transition(JobState.FAILED, f"failed ({how})")


# -- ticks --------------------------------------------------------------------------------------


def work_left(estimate: float, ran: float) -> float:
    """Predicted work left of a job that ran ``ran`` s of an ``estimate`` from history; past the
    estimate, as long again as it ran (run times are heavy-tailed: a job that outlived its estimate
    is likely a long one)."""
    return max(estimate - ran, ran)


class SchedulerCore:
    """The scheduler's decisions over one cluster, one policy and one executor's reach.

    Args:
        nodes: the cluster (node indices in placements are positions in this list).
        policy: the scheduling policy.
        estimator: run-time estimates from history (the driver feeds it finished jobs).
        elastic: how elastic jobs grow and shrink.
        multi_node: whether the executor spreads one job over several nodes.
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        policy: Policy,
        estimator: RuntimeEstimator | None = None,
        elastic: ElasticConfig | None = None,
        multi_node: bool = True,
    ) -> None:
        self.nodes = list(nodes)
        self.policy = policy
        self.estimator = estimator or RuntimeEstimator()
        self.elastic = elastic or ElasticConfig()
        self.multi_node = multi_node
        self.node_index = {n.name: i for i, n in enumerate(self.nodes)}

    # -- views to the policy's records ------------------------------------------------------------

    def queued(self, job: JobView) -> QueuedJob:
        """A queued job as the policy sees it: an elastic job waits for its smallest size."""
        res = job.spec.resources
        return QueuedJob(
            id=job.id,
            gpus=job.sizes[0] if job.elastic else job.gpus,
            team=job.team,
            user=job.user,
            priority=job.priority,
            submit_time=job.submitted_at,
            estimate=self.estimator.estimate(job.team, job.user, job.gpus),
            gpu_type=res.gpu_type,
            cpus=res.cpus,
            attained=job.attained_s,
            enqueued_at=job.queued_at,
            workload=job.workload,
            share=job.share,
            avoid=frozenset(self.node_index[n] for n in job.avoid_nodes if n in self.node_index),
            sizes=job.sizes if job.elastic else (),
            resize_to=job.resize_to,
        )

    def running(self, job: JobView, now: float) -> RunningJob:
        """A job holding GPUs as the policy sees it (``now`` stands in for a start not recorded yet)."""
        nodes = tuple((self.node_index.get(p.node, 0), len(p.gpus)) for p in job.placement)
        started = job.started_at if job.started_at is not None else now
        estimate = self.estimator.estimate(job.team, job.user, job.gpus)
        return RunningJob(
            id=job.id,
            gpus=job.gpus,
            team=job.team,
            priority=job.priority,
            started_at=started,
            expected_end=started + max(estimate - job.attained_s, 1.0),
            placement=Placement(nodes, "running"),
            gpu_type=job.spec.resources.gpu_type,
            stopping=job.stop is not None,
            attained=job.attained_s,
        )

    def elastic_job(self, job: JobView, now: float) -> ElasticJob:
        """A running elastic job as the resize rules see it."""
        run = self.running(job, now)
        ran = job.attained_s + now - run.started_at
        return ElasticJob(
            id=job.id,
            gpus=job.gpus,
            sizes=job.sizes,
            placement=run.placement,
            started_at=run.started_at,
            remaining_s=work_left(self.estimator.estimate(job.team, job.user, job.gpus), ran),
            gpu_type=job.spec.resources.gpu_type,
        )

    def hold(self, cluster: ClusterState, views: Iterable[JobView]) -> None:
        """Make ``cluster``'s free slots those the jobs holding GPUs leave (nodes unknown here: skipped)."""
        cluster.reset()
        for job in views:
            if not job.holds:
                continue
            for part in job.placement:
                i = self.node_index.get(part.node)
                if i is not None:
                    cluster.hold_record(i, part.record())

    # -- decisions --------------------------------------------------------------------------------

    def drain_stops(self, views: Iterable[JobView], cluster: ClusterState) -> list[Stop]:
        """Stop the preemptible running jobs on drained nodes, so they move off them."""
        drained = {self.nodes[i].name for i in range(len(self.nodes)) if cluster.drained[i]}
        if not drained:
            return []
        stops = []
        for job in views:
            on = sorted(drained & job.on_nodes())
            if job.state is not JobState.RUNNING or not on or job.stop is not None or not job.preemptible:
                continue
            why = f"node {', '.join(on)} drained: preempted to move off it"
            stops.append(Stop(job.id, StopReason.PREEMPT, why))
        return stops

    def tick(self, views: Sequence[JobView], cluster: ClusterState, now: float, launch: bool = True) -> Plan:
        """One scheduling pass over every job not over yet (the server's tick).

        ``cluster`` holds the active jobs' placements and the drained nodes (:meth:`hold`); it is not
        changed. With ``launch`` False (the executor does not answer) only the drained nodes' stops
        are planned: nothing starts or is preempted.
        """
        drains = self.drain_stops(views, cluster)
        if not launch:
            return Plan(stops=drains)
        stopping = {s.job for s in drains}
        active = [v for v in views if v.holds]
        if any(v.stop is StopReason.RESIZE for v in active):
            elastic = []  # nothing is resized while an earlier resize is still stopping a job
        else:
            elastic = [
                self.elastic_job(v, now)
                for v in active
                if v.state is JobState.RUNNING and v.stop is None and v.elastic and v.id not in stopping
            ]
        queue = JobQueue(self.policy.key)
        for v in views:
            if v.waiting:
                queue.add(self.queued(v))
        cluster.observe(task_shapes(views, cluster))
        # Share and MIG jobs hold no whole GPU: policies neither count nor preempt them.
        running = [
            self.running(replace_stop(v, v.id in stopping), now)
            for v in active
            if v.placement and v.share is None
        ]
        plan = self.decide(cluster, queue, running, elastic, now)
        plan.stops[:0] = drains
        return plan

    def decide(
        self,
        cluster: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        elastic: Sequence[ElasticJob],
        now: float,
        preempt: bool = True,
        explain: bool = True,
    ) -> Plan:
        """The policy's starts and preemptions, elastic jobs started at their best size, and
        elastic jobs resized: grown into idle GPUs when nothing waits, shrunk when that lets the
        first queued job start (the rules of :mod:`gpuyard.scheduler.elastic`).

        ``elastic`` lists the running elastic jobs a resize may touch; ``preempt`` whether a
        preemptive policy may preempt now; ``explain`` whether to say why each job left waits.
        """
        enabled = self.elastic.enabled
        if not queue:
            if not enabled or not elastic or cluster.free_gpus <= 0:
                return Plan()
            grows = plan_grows(cluster, elastic, now, self.elastic, self.multi_node)
            return Plan(stops=[self._resize(j, n, elastic, "grow into idle GPUs") for j, n in grows])
        decision = self.policy.decide(
            cluster, queue, running, now, multi_node=self.multi_node, preempt=preempt
        )
        why = f"preemption requested by policy {self.policy.name}"
        stops = [Stop(jid, StopReason.PREEMPT, why) for jid in decision.preempt]
        starts = self._elastic_starts(cluster, decision.starts, len(queue))
        waiting = self._why_waiting(cluster, queue, starts, decision.waits) if explain else {}
        first = next(queue.ordered()) if enabled and elastic and not decision.preempt else None
        started = {j.id for j, _ in starts} | set(decision.waits) if first is not None else set()
        if first is not None and first.id not in started and first.share is None:
            after = cluster.copy()  # with this decision's starts taken
            for _, placement in starts:
                after.take(placement)
            shrinks = plan_shrinks(
                after, first.gpus, first.gpu_type, elastic, now, self.elastic, self.multi_node
            )
            why = f"shrink to let job {first.id} start"
            stops += [self._resize(j, n, elastic, why) for j, n in shrinks]
        return Plan([Start(q.id, p) for q, p in starts], stops, dict(decision.waits), waiting)

    def _resize(self, job: int, gpus: int, elastic: Sequence[ElasticJob], why: str) -> Stop:
        was = next(j.gpus for j in elastic if j.id == job)
        note = f"{why}: from {was} to {gpus} GPUs (checkpoint, then restart at the new size)"
        return Stop(job, StopReason.RESIZE, note, gpus)

    def _elastic_starts(
        self, cluster: ClusterState, starts: list[tuple[QueuedJob, Placement]], queued: int
    ) -> list[tuple[QueuedJob, Placement]]:
        """The policy's starts, with each elastic job grown to its size: the size it was resized to,
        else its maximum when no other job is left waiting, as far as the free GPUs allow."""
        if not any(j.sizes for j, _ in starts):
            return starts
        work = cluster.copy()
        for _, placement in starts:
            work.take(placement)
        waiting = queued > len(starts)
        out = []
        for job, placement in starts:
            target = job.resize_to or (job.sizes[-1] if job.sizes and not waiting else placement.gpus)
            if placement.parts or not placement.gpus or target <= placement.gpus:
                out.append((job, placement))
                continue
            work.release(placement)
            fits = [n for n in job.sizes if placement.gpus <= n <= target]
            drained = work.drained
            work.drain_more(job.avoid)  # nodes it must not use (a straggler's): for its placement only
            grown = largest_fit(work, fits, job.gpu_type, self.multi_node) or placement
            work.drained = drained
            work.take(grown)
            out.append((job, grown))
        return out

    def _why_waiting(
        self,
        cluster: ClusterState,
        queue: JobQueue,
        starts: list[tuple[QueuedJob, Placement]],
        waits: Mapping[int, str],
    ) -> dict[int, str]:
        """Why each job left queued waits, on the cluster after this decision's starts."""
        work = cluster.copy()
        for _, placement in starts:
            work.take(placement)
        started = {j.id for j, _ in starts} | set(waits)
        return {
            j.id: why_waiting(work, j.gpus, j.gpu_type, j.share, j.cpus, self.multi_node)
            for j in queue.ordered()
            if j.id not in started
        }


def task_shapes(views: Iterable[JobView], cluster: ClusterState) -> Counter[tuple[Any, ...]]:
    """The jobs known now (queued and holding) as the share policy's task shapes, counted: (CPU, memory,
    GPUs, thousandths per GPU, GPU models) as :attr:`gpuyard.scheduler.openb.GpuTask.shape`; whole-GPU
    and CPU-only jobs count too, MIG jobs do not (FGD's mix measures the room for shares and whole
    GPUs). A share by memory alone is its part of the largest GPU memory known here."""
    largest = float(cluster.gpu_memory.max()) if len(cluster.gpu_memory) else 0.0
    shapes: Counter[tuple[Any, ...]] = Counter()
    for v in views:
        if not (v.waiting or v.holds):
            continue
        spec = (v.spec.resources.gpu_type,) if v.spec.resources.gpu_type else ()
        if v.share is None:
            shapes[(0, 0, v.gpus, MILLI if v.gpus else 0, spec)] += 1
        elif not v.share.mig:
            fraction = v.share.fraction
            if fraction is None and v.share.memory_gb is not None and largest > 0:
                fraction = min(1.0, v.share.memory_gb / largest)
            if fraction is not None:
                shapes[(0, 0, 1, max(1, round(fraction * MILLI)), spec)] += 1
    return shapes


def replace_stop(job: JobView, stopping: bool) -> JobView:
    """``job``, marked as stopping (a preemption planned in this same tick) when ``stopping``."""
    if not stopping or job.stop is not None:
        return job
    return replace(job, stop=StopReason.PREEMPT)


def seconds(when: datetime | None) -> float | None:
    """A stored time as seconds since the epoch (None stays None)."""
    return when.timestamp() if when is not None else None
