"""Trace replay on a virtual cluster with a virtual clock, through the server's policies and placement.

Events are submissions and completions; after each instant's events the policy decides once.
Preemption is modelled as the real thing behaves: the victim checkpoints on SIGTERM, but work since
its last periodic checkpoint is lost, and it pays a restart overhead (grace period, process start,
checkpoint load) when it runs again.

With workloads and a fabric cluster, a job's trace duration is its run time on its consolidated
placement; placed elsewhere it runs slower by the fabric model's predicted step-time ratio, whatever
the placement policy (topology-only or fabric-aware), so both are judged by the same physics.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard import exitcodes
from gpuyard.errors import CapacityError, ConfigError
from gpuyard.scheduler.core import JobView, SchedulerCore, StopReason, on_exit, work_left
from gpuyard.scheduler.elastic import ElasticConfig, ElasticJob
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.executors.base import ExitStatus
from gpuyard.scheduler.fabric_placement import FabricPlacer, shape_of
from gpuyard.scheduler.placement import (
    ClusterState,
    GpuShare,
    NodeSpec,
    Placement,
    share_never_fits,
)
from gpuyard.scheduler.policies import Policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob
from gpuyard.scheduler.spec import JobSpec, JobState, parse_spec
from gpuyard.scheduler.trace import TraceJob

BOUNDED_SLOWDOWN_S = 10.0  # floor on run time in the slowdown (Feitelson's bounded slowdown)


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the virtual cluster's behaviour (not of the policy).

    Attributes:
        checkpoint_interval_s: a preempted or failed job loses the work done since its last periodic
            checkpoint.
        restart_overhead_s: grace period + restart + checkpoint load, paid by a resumed job.
        preempt_check_s: a preemptive policy may preempt at most this often (its scheduling interval).
        failures: the failure model injected into running jobs (None: jobs never fail).
        failure_seed: seed of the failure times.
        gpus_per_node: GPUs per node, for the failure model's per-node rate.
        checkpoint_stall_s: training time each checkpoint stops the job for (0: free checkpoints,
            as before failures were modelled).
        elastic_alpha: how an elastic job's speed scales with its GPUs (``(g / g0) ** alpha``).
        max_restarts: every job's ``max_restarts`` (its spec's): after a failure it runs again while
            its failures do not pass it, else it ends failed, as the server's exit rules say
            (:func:`gpuyard.scheduler.core.on_exit`). None: no limit (a long training run at scale
            fails hundreds of times and is restarted each time; a spec allows at most 100).
    """

    checkpoint_interval_s: float = 600.0
    restart_overhead_s: float = 60.0
    preempt_check_s: float = 300.0
    # Failures injected into running jobs (``gpuyard.fabric.failures.FailureModel``; None: none). A job
    # on G GPUs fails after an exponential time of rate ``failures.rate_per_hour(G, gpus_per_node)``;
    # it loses the work since its last checkpoint, is queued again and pays the restart overhead.
    failures: Any = None
    failure_seed: int = 0
    gpus_per_node: int = 8
    checkpoint_stall_s: float = 0.0
    # Elastic jobs (``simulate(elastic=...)``): a job on g GPUs instead of the g0 it asked for runs at
    # (g / g0) ** elastic_alpha of its speed (sublinear scaling: an assumption, not a measurement).
    elastic_alpha: float = 0.8
    max_restarts: int | None = None

    @property
    def stall_factor(self) -> float:
        """Wall time per second of work: each checkpoint interval also pays the checkpoint's stall."""
        return 1.0 + self.checkpoint_stall_s / self.checkpoint_interval_s


@dataclass
class _Run:
    job: TraceJob
    remaining: float  # work left, seconds on its asked-for GPUs, consolidated, without stalls
    overhead: float = 0.0  # restart seconds the current (or next) attempt spends before progressing
    alloc: int = 0  # GPUs it holds now (an elastic job's change)
    bounds: tuple[int, int] | None = None  # an elastic job's (min, max) GPUs
    resizes: int = 0
    resize_to: int | None = None  # the size a resize restarts it at
    sizes: tuple[int, ...] = ()  # an elastic job's sizes: every one of its range
    productive: float = 0.0  # wall seconds whose progress was kept (at its speed, on its placement)
    lost_gpu_s: float = 0.0  # GPU-seconds held without kept progress: restarts, lost work, stalls
    first_start: float = math.nan
    finish: float = math.nan
    failed: bool = False  # ended failed: a failure past its max_restarts
    busy: float = 0.0  # GPU-holding seconds, for utilization
    preemptions: int = 0
    failures: int = 0
    attained: float = 0.0
    started_at: float = 0.0
    version: int = 0
    ratio: float = 1.0  # run-time factor of the current placement (fabric model; 1 = consolidated)
    multi_node: bool = False
    multi_leaf: bool = False
    slowed: bool = False
    gpu_type: str | None = None  # the GPU type it must run on (None: any)
    share: GpuShare | None = None  # part of one GPU or MIG slices (then its trace ``gpus`` is 0)


@dataclass
class SimResult:
    """What a replay measured; ``to_dict`` is the `gpuyard sim --json` document."""

    policy: str
    jobs: int
    avg_jct_s: float
    median_jct_s: float
    p99_jct_s: float
    avg_queue_s: float
    makespan_s: float
    utilization: float
    preemptions: int
    rejected: int
    fairness_jain: float
    teams: dict[str, dict[str, float]] = field(default_factory=dict)
    multi_node_jobs: int = 0  # jobs that ran on more than one node at least once
    multi_leaf_jobs: int = 0  # jobs that ran across leaf switches at least once
    slowed_jobs: int = 0  # jobs that ran slower than on their consolidated placement (fabric model)
    fabric_waits: int = 0  # jobs that fabric-aware placement kept waiting for consolidation at least once
    failures: int = 0  # injected failures (SimConfig.failures)
    failed_jobs: int = 0  # jobs that ended failed: a failure past SimConfig.max_restarts
    # GPU-weighted effective training time ratio: the work of the trace over the time from each job's
    # first start to its end (restarts, requeue waits after failures, lost work and slowdowns count
    # against it; the first queueing does not).
    ettr: float = 1.0
    lost_gpu_hours: float = 0.0  # GPU time held without progress kept (work lost + restart overheads)
    elastic_jobs: int = 0
    resizes: int = 0  # elastic grows and shrinks (each a checkpoint and a restart at the new size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dict(self.__dict__)


def simulate(
    trace: list[TraceJob],
    nodes: list[NodeSpec],
    policy: Policy,
    config: SimConfig | None = None,
    workloads: dict[int, Any] | None = None,
    fabric: Any = None,
    elastic: dict[int, tuple[int, int]] | None = None,
    cluster: ClusterState | None = None,
    gpu_types: dict[int, str] | None = None,
    shares: dict[int, GpuShare] | None = None,
    held: dict[int, Placement] | None = None,
    multi_node: bool = True,
) -> SimResult:
    """Replay ``trace`` on ``nodes`` under ``policy``: the scheduling core the server runs
    (:class:`gpuyard.scheduler.core.SchedulerCore`) decides on a virtual clock, and a fake executor
    carries out its plans (a start holds GPUs until the job's end or failure event; a stop is at once).

    Jobs larger than the whole cluster are counted as rejected (the server refuses them at submit).

    Args:
        trace: the jobs.
        nodes: the virtual cluster.
        policy: the scheduling policy (its ``placer`` set for fabric-aware placement).
        config: preemption costs.
        workloads: job id -> ``gpuyard.fabric.placement_cost.Workload``; jobs of this map run slower
            on placements the fabric model predicts slower than their consolidated one.
        fabric: the fabric cluster of ``nodes`` (needed with ``workloads``).
        elastic: job id -> (min, max) GPUs of the jobs that may grow and shrink, by the server's rules
            (:mod:`gpuyard.scheduler.elastic`, every size of the range allowed; ``preempt_check_s`` is
            the least time between a job's start and its resize, ``restart_overhead_s`` a restart's
            cost). A resize is a checkpoint on demand (no work lost), a requeue and a restart at the
            new size.
        cluster: the virtual cluster to start from, built on ``nodes`` (its packing policy with the
            task mix it observed, its drained nodes); changed by the replay, so a fresh one per call.
            None: ``ClusterState(nodes)``.
        gpu_types: job id -> the GPU type it must run on (the server's typed placement).
        shares: job id -> its part of one GPU or MIG slices (its trace ``gpus`` is 0), placed by the
            cluster's packing policy on the share model as the server places them; like the server's
            tick, the policy neither counts nor preempts them once they run.
        held: job id -> where it already runs: it holds that placement from time 0 (submit 0), not
            placed by the policy (the forward run of a live cluster, :mod:`gpuyard.scheduler.eta`).
        multi_node: whether one job may span several nodes (the executor's reach: the local
            executor's may not); jobs larger than one node are then rejected.

    Raises:
        CapacityError: no job of the trace fits on the cluster.
        ConfigError: workloads without a fabric cluster; a ``cluster`` of other nodes.
    """
    config = config or SimConfig()
    workloads = workloads or {}
    if workloads and fabric is None:
        raise ConfigError("simulating workloads needs the fabric cluster of the nodes")
    if cluster is not None and len(cluster.nodes) != len(nodes):
        raise ConfigError(f"the cluster to start from has {len(cluster.nodes)} nodes, not {len(nodes)}")
    state = cluster if cluster is not None else ClusterState(nodes)
    total = state.total_gpus
    gpu_types, shares, held = gpu_types or {}, shares or {}, held or {}
    runs = {}
    for j in trace:
        kind, share = gpu_types.get(j.id), shares.get(j.id)
        if j.id in held or _fits_empty(state, j.gpus, kind, share, multi_node):
            runs[j.id] = _Run(j, j.duration, gpu_type=kind, share=share)
    for jid, (low, high) in (elastic or {}).items():
        if jid in runs:
            if not 1 <= low <= high:
                raise ConfigError(f"elastic job {jid}: bounds {low}..{high} are not 1 <= min <= max")
            runs[jid].bounds = (low, min(high, total))
            runs[jid].sizes = tuple(range(low, min(high, total) + 1))
    if not runs:
        raise CapacityError(f"no job of the trace fits on {total} GPUs")
    resizing = ElasticConfig(
        enabled=bool(elastic),
        interval_s=config.preempt_check_s,
        restart_cost_s=config.restart_overhead_s,
        alpha=config.elastic_alpha,
    )
    core = SchedulerCore(nodes, policy, RuntimeEstimator(), resizing, multi_node)
    replay = _Replay(core, state, runs, config, workloads, FabricPlacer(fabric) if workloads else None)
    for jid, placement in sorted(held.items()):
        if jid in runs:
            replay.hold(runs[jid], placement)
    arrivals = [r for r in runs.values() if r.job.id not in held]
    replay.run(sorted(arrivals, key=lambda r: (r.job.submit, r.job.id)))
    result = _result(policy.name, list(runs.values()), len(trace) - len(runs), total, replay.preemptions)
    result.fabric_waits, result.failures = len(replay.waited), replay.failures
    result.failed_jobs = sum(r.failed for r in runs.values())
    result.elastic_jobs = sum(r.bounds is not None for r in runs.values())
    result.resizes = sum(r.resizes for r in runs.values())
    return result


def _fits_empty(
    state: ClusterState, gpus: int, gpu_type: str | None, share: GpuShare | None, multi_node: bool
) -> bool:
    """Whether a job could ever start on the cluster (the server refuses the others at submit)."""
    if share is not None:
        return share_never_fits(state, share, gpu_type) is None
    return 0 < gpus <= state.max_gpus(gpu_type, multi_node)


class _Replay:
    """The simulator's driver of the core: a virtual clock (the next submission, end, failure or
    resize check) and a fake executor (GPUs held in ``state``, ends on a heap)."""

    def __init__(
        self,
        core: SchedulerCore,
        state: ClusterState,
        runs: dict[int, _Run],
        config: SimConfig,
        workloads: dict[int, Any],
        costs: FabricPlacer | None,
    ) -> None:
        self.core, self.state, self.runs, self.config = core, state, runs, config
        self.workloads, self.costs = workloads, costs
        self.policy = core.policy
        self.queue = JobQueue(core.policy.key)
        self.running: dict[int, RunningJob] = {}
        # (time, job id, version, failed): lazy deletion on a stop; failed: a failure, not the end;
        # job id -1: a resize check (an elastic job's interval since its start is over).
        self.ends: list[tuple[float, int, int, bool]] = []
        self.rng = np.random.default_rng(config.failure_seed)
        self.preemptions = self.failures = 0
        self.waited: set[int] = set()
        self.next_check = 0.0
        self.elastic_running: set[int] = set()  # running jobs with a size range
        self.estimates: dict[tuple[str, str, int], float] = {}  # history's estimates, until a job ends
        self.elastic_seen: dict[int, tuple[int, ElasticJob]] = {}  # job -> (its run's version, record)
        self.specs: dict[bool, JobSpec] = {}  # the exit rules' spec of rigid and elastic jobs
        self.pin = any(r.share is not None for r in runs.values())  # shares: pin whole GPUs (_start)
        self.pinned: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # job -> whole GPUs pinned

    def run(self, arrivals: list[_Run]) -> None:
        nxt, ends, queue = 0, self.ends, self.queue
        while nxt < len(arrivals) or ends:
            now = min(
                arrivals[nxt].job.submit if nxt < len(arrivals) else math.inf,
                ends[0][0] if ends else math.inf,
            )
            while ends and ends[0][0] <= now:
                _, jid, version, failed = heapq.heappop(ends)
                if jid < 0 or version != self.runs[jid].version:
                    continue
                if failed:
                    self.failures += 1
                self._exit(self.runs[jid], now, ExitStatus(code=1 if failed else 0))
            while nxt < len(arrivals) and arrivals[nxt].job.submit <= now:
                queue.add(_queued(arrivals[nxt], self.core.estimator, now, self.workloads))
                nxt += 1
            self._tick(now)

    def hold(self, run: _Run, placement: Placement) -> None:
        """``run`` already holds ``placement`` at time 0 (a live job): it starts there, unplaced."""
        self.queue.add(_queued(run, self.core.estimator, 0.0, self.workloads))
        self._start(run, placement, 0.0)

    def _release(self, jid: int) -> None:
        """Give back what job ``jid`` holds: its placement, and the whole GPUs pinned for it."""
        self.state.unpin(self.pinned.pop(jid, []))
        self.state.release(self.running.pop(jid).placement)

    def _tick(self, now: float) -> None:
        """Let the core decide at ``now``, and carry out its plan; again at once after a resize (the
        resized job is queued and starts at its new size, as on the server's next tick)."""
        for _ in range(3):
            if not self.queue and not self.elastic_running:
                return  # nothing waits and nothing could grow
            check = self.policy.preemptive and now >= self.next_check
            free = self.state.free_gpus
            if self.queue:
                if not (free >= self.queue.min_gpus() or check or self._may_shrink(now, free)):
                    return
            elif free <= 0 or not self._due(now):
                return
            elastic = self._resizable(now) if self.elastic_running else []
            if check and self.queue:
                self.next_check = now + self.config.preempt_check_s
            # As on the server (SchedulerCore.tick): share and MIG jobs are not counted nor preempted.
            running = [r for jid, r in self.running.items() if self.runs[jid].share is None]
            plan = self.core.decide(
                self.state,
                self.queue,
                running,
                elastic,
                now,
                preempt=check,
                explain=False,
            )
            self.waited.update(plan.waits)
            for stop in plan.stops:
                run = self.runs[stop.job]
                if stop.reason is StopReason.RESIZE:
                    run.resizes += 1
                else:
                    self.preemptions += 1
                # The job checkpoints on SIGTERM and asks to be resumed (the trainer's exit code).
                self._exit(run, now, ExitStatus(code=exitcodes.PREEMPTED), stop.reason, stop.gpus)
            for start in plan.starts:
                self._start(self.runs[start.job], start.placement, now)
            if not plan.resizes:
                return

    def _may_shrink(self, now: float, free: int) -> bool:
        """Whether shrinking the running elastic jobs to their minimum could free enough GPUs for the
        first queued job (else the core's shrink pass would plan nothing: not asked)."""
        if not self.elastic_running:
            return False
        spare = sum(r.alloc - r.bounds[0] for r in self._due(now) if r.bounds is not None)
        return spare > 0 and free + spare >= next(self.queue.ordered()).gpus

    def _due(self, now: float) -> list[_Run]:
        """The running elastic jobs past their interval since their start (the others are not resized)."""
        interval = self.core.elastic.interval_s
        return [
            self.runs[jid]
            for jid in sorted(self.elastic_running)
            if now - self.running[jid].started_at >= interval
        ]

    def _resizable(self, now: float) -> list[ElasticJob]:
        """The running elastic jobs the resize rules may touch now, as they see them (their work left
        from history). Only a grow reads the work left: while jobs wait (a shrink pass), each job's
        record from its last grow pass or start is taken again rather than built anew."""
        out, grow = [], not self.queue
        for run in self._due(now):
            cached = self.elastic_seen.get(run.job.id)
            if not grow and cached is not None and cached[0] == run.version:
                out.append(cached[1])
                continue
            held, j = self.running[run.job.id], run.job
            key = (j.team, j.user, run.alloc)
            estimate = self.estimates.get(key)
            if estimate is None:
                estimate = self.estimates[key] = self.core.estimator.estimate(*key)
            ran = run.attained + now - held.started_at
            left = work_left(estimate, ran)
            job = ElasticJob(j.id, run.alloc, run.sizes, held.placement, held.started_at, left)
            self.elastic_seen[j.id] = (run.version, job)
            out.append(job)
        return out

    def _start(self, run: _Run, placement: Placement, now: float) -> None:
        """Run ``run`` on ``placement`` from ``now``: its end (or failure) event goes on the heap."""
        qjob = self.queue.remove(run.job.id)
        _slowdown(run, placement, self.state, self.costs, self.workloads.get(run.job.id))
        if math.isnan(run.first_start):
            run.first_start = now
        # An oracle policy knows the true remaining time of what runs (srtf-oracle preempts by it);
        # every other policy sees the history estimate.
        estimate = run.remaining if self.policy.needs_oracle else qjob.estimate - qjob.attained
        config = self.config
        self.state.take(placement)
        if self.pin:
            # A whole-GPU start's GPUs, held in the share model as the server's records hold them
            # (each node's first whole free ones, as the launch gives them); else every share
            # placement after it would hold and give them back again (place_share).
            self.pinned[run.job.id] = self.state.pin_whole()
        run.alloc, run.resize_to = placement.gpus, None
        run.started_at, run.version = now, run.version + 1
        speed = _speed(run, config)
        self.running[run.job.id] = RunningJob(
            run.job.id,
            run.alloc,
            run.job.team,
            run.job.priority,
            now,
            now + max(estimate, 1.0) * run.ratio / speed,
            placement,
            gpu_type=run.gpu_type,
            attained=run.attained,
        )
        end = now + run.overhead + run.remaining * run.ratio * config.stall_factor / speed
        fail = _failure_time(config, run.alloc, now, self.rng)
        heapq.heappush(self.ends, (min(end, fail), run.job.id, run.version, fail < end))
        if run.bounds is not None and run.bounds[0] < run.bounds[1]:
            self.elastic_running.add(run.job.id)
            heapq.heappush(self.ends, (now + config.preempt_check_s, -1, 0, False))  # resize check

    def _exit(
        self,
        run: _Run,
        now: float,
        status: ExitStatus,
        stop: StopReason | None = None,
        resize_to: int | None = None,
    ) -> None:
        """An attempt ended (``status``; stopped for ``stop``): what happens next is what the server's
        exit rules say (:func:`gpuyard.scheduler.core.on_exit`): it succeeded, is queued again (a
        resize keeps all its work, a preemption or failure what its last checkpoint kept), or ended
        failed."""
        out = on_exit(self._view(run, stop, resize_to), status)
        run.failures, run.preemptions = out.failures, out.preemptions
        if out.state is JobState.SUCCEEDED:
            self._finish(run, now)
        elif out.state is JobState.QUEUED:
            resized = stop is StopReason.RESIZE
            self._stop(run, now, keep_all=resized, resize_to=resize_to if out.keep_resize else None)
        else:
            self._end(run, now)

    def _view(self, run: _Run, stop: StopReason | None, resize_to: int | None) -> JobView:
        """A running job as the exit rules see it."""
        j = run.job
        elastic = run.bounds is not None
        spec = self.specs.get(elastic)
        if spec is None:  # what the exit rules read of a spec: max_restarts, and whether it is elastic
            gpus: Any = {"min": 1, "max": 2} if elastic else 1
            most = self.config.max_restarts
            spec = parse_spec({"name": "trace", "command": ["true"], "resources": {"gpus": gpus}})
            # No limit: past the spec's bound (a simulated job only), so not validated again.
            limit = most if most is not None else 2**62
            spec = self.specs[elastic] = spec.model_copy(update={"max_restarts": limit})
        return JobView(
            id=j.id,
            state=JobState.RUNNING,
            name=spec.name,
            team=j.team,
            user=j.user,
            priority=j.priority,
            gpus=run.alloc,
            spec=spec,
            sizes=run.sizes or (j.gpus,),
            submitted_at=j.submit,
            queued_at=j.submit,
            failures=run.failures,
            preemptions=run.preemptions,
            started_at=run.started_at,
            stop=stop,
            resize_to=resize_to,
        )

    def _end(self, run: _Run, now: float) -> None:
        """A job that ended failed: its GPUs are free, its work since the last checkpoint lost."""
        self._release(run.job.id)
        self.elastic_running.discard(run.job.id)
        self.elastic_seen.pop(run.job.id, None)
        _stop(run, now, self.config, keep_all=False)
        run.finish, run.failed = now, True

    def _stop(self, run: _Run, now: float, keep_all: bool, resize_to: int | None = None) -> None:
        """Stop a running job (preempted, failed, or resized with ``keep_all``): queued again."""
        self._release(run.job.id)
        self.elastic_running.discard(run.job.id)
        _stop(run, now, self.config, keep_all=keep_all)
        run.resize_to = resize_to
        self.queue.add(_queued(run, self.core.estimator, now, self.workloads))

    def _finish(self, run: _Run, now: float) -> None:
        self._release(run.job.id)
        self.elastic_running.discard(run.job.id)
        self.elastic_seen.pop(run.job.id, None)
        _account(run, now - run.started_at, run.remaining, self.config)
        run.finish = now
        self.core.estimator.observe(run.job.team, run.job.user, run.job.gpus, run.job.duration)
        self.estimates.clear()


def _speed(run: _Run, config: SimConfig) -> float:
    """Speed of ``run`` on the GPUs it holds, relative to the GPUs it asked for."""
    if run.bounds is None or run.alloc == run.job.gpus:
        return 1.0
    return float((run.alloc / run.job.gpus) ** config.elastic_alpha)


def _stop(run: _Run, now: float, config: SimConfig, keep_all: bool) -> float:
    """Account an attempt that stops ``now``; returns the work it keeps (seconds on the asked-for GPUs).

    The attempt first spent its restart overhead; its progress after that, at its speed, is kept up to
    the last periodic checkpoint (all of it with ``keep_all``: a checkpoint on demand). The next
    attempt pays the restart overhead again.
    """
    ran = now - run.started_at
    progress = max(0.0, ran - run.overhead) * _speed(run, config) / (run.ratio * config.stall_factor)
    progress = min(progress, run.remaining)
    saved = progress if keep_all else progress - progress % config.checkpoint_interval_s
    _account(run, ran, saved, config)
    run.remaining -= saved
    run.attained += saved
    run.overhead = config.restart_overhead_s
    run.version += 1  # its pending end event no longer counts
    return saved


def _failure_time(config: SimConfig, gpus: int, now: float, rng: np.random.Generator) -> float:
    """When a job starting ``now`` on ``gpus`` GPUs next fails (inf without a failure model)."""
    if config.failures is None:
        return math.inf
    rate = config.failures.rate_per_hour(gpus, config.gpus_per_node) / 3600.0
    return now + float(rng.exponential(1.0 / rate)) if rate > 0 else math.inf


def _slowdown(
    run: _Run, placement: Placement, state: ClusterState, costs: FabricPlacer | None, workload: Any
) -> None:
    """Set the run-time factor of a job starting on ``placement`` (1 on its consolidated placement)."""
    run.ratio = 1.0
    if sum(1 for _, n in placement.nodes if n) < 2:
        return  # one node is every job's best when it fits one (else it could not be placed there)
    run.multi_node = True
    shape = shape_of(state, placement)
    run.multi_leaf = run.multi_leaf or shape.leaves > 1
    if costs is None or workload is None:
        return
    ideal = costs.ideal(state, run.job.gpus, None)
    step = costs.step(workload, shape)
    best = costs.step(workload, shape_of(state, ideal)) if ideal is not None else None
    if step is not None and best is not None and step > best:
        run.ratio = step / best
        run.slowed = run.slowed or run.ratio > 1 + costs.tolerance


def _queued(run: _Run, estimator: RuntimeEstimator, now: float, workloads: dict[int, Any]) -> QueuedJob:
    j = run.job
    return QueuedJob(
        id=j.id,
        gpus=run.bounds[0] if run.bounds is not None else j.gpus,
        team=j.team,
        user=j.user,
        priority=j.priority,
        submit_time=j.submit,
        estimate=estimator.estimate(j.team, j.user, j.gpus),
        duration=run.remaining + run.attained,
        attained=run.attained,
        enqueued_at=now,
        workload=workloads.get(j.id),
        gpu_type=run.gpu_type,
        share=run.share,
        sizes=run.sizes,
        resize_to=run.resize_to,
    )


def _result(name: str, runs: list[_Run], rejected: int, total_gpus: int, preemptions: int) -> SimResult:
    submit = np.array([r.job.submit for r in runs])
    finish = np.array([r.finish for r in runs])
    jct = finish - submit
    duration = np.array([r.job.duration for r in runs])
    queue_s = jct - np.array([r.busy for r in runs])
    makespan = float(finish.max() - submit.min())
    gpu_s = float(sum(r.busy * r.job.gpus for r in runs))
    slowdown = jct / np.maximum(duration, BOUNDED_SLOWDOWN_S)
    teams: dict[str, dict[str, float]] = {}
    team_of = np.array([r.job.team for r in runs])
    for team in sorted(set(team_of.tolist())):
        m = team_of == team
        teams[team] = {
            "jobs": int(m.sum()),
            "avg_jct_s": float(jct[m].mean()),
            "avg_queue_s": float(queue_s[m].mean()),
            "avg_slowdown": float(slowdown[m].mean()),
            "gpu_hours": float(sum(r.busy * r.job.gpus for r, k in zip(runs, m, strict=True) if k) / 3600.0),
        }
    per_team = np.array([t["avg_slowdown"] for t in teams.values()])
    jain = float(per_team.sum() ** 2 / (len(per_team) * (per_team**2).sum())) if per_team.size else 1.0
    return SimResult(
        policy=name,
        jobs=len(runs),
        avg_jct_s=float(jct.mean()),
        median_jct_s=float(np.median(jct)),
        p99_jct_s=float(np.percentile(jct, 99)),
        avg_queue_s=float(queue_s.mean()),
        makespan_s=makespan,
        utilization=gpu_s / (total_gpus * makespan) if makespan > 0 else 0.0,
        preemptions=preemptions,
        rejected=rejected,
        fairness_jain=jain,
        teams=teams,
        ettr=_ettr(runs),
        lost_gpu_hours=float(sum(r.lost_gpu_s for r in runs) / 3600.0),
        multi_node_jobs=sum(r.multi_node for r in runs),
        multi_leaf_jobs=sum(r.multi_leaf for r in runs),
        slowed_jobs=sum(r.slowed for r in runs),
    )


def _account(run: _Run, ran: float, kept: float, config: SimConfig) -> None:
    """An attempt held ``run.alloc`` GPUs for ``ran`` s and kept ``kept`` s of work: what was productive."""
    productive = min(ran, kept * run.ratio / _speed(run, config))
    run.busy += ran
    run.productive += productive
    run.lost_gpu_s += run.alloc * (ran - productive)


def _ettr(runs: list[_Run]) -> float:
    """GPU-weighted productive time / (end - first start): the share of a job's time that advanced it.

    Productive: wall time whose progress was kept (slower on a spread placement or fewer GPUs, but
    progress). Not: restarts, work lost since the last checkpoint, checkpoint stalls and requeue
    waits after a failure or preemption.
    """
    wall = sum(r.job.gpus * (r.finish - r.first_start) for r in runs)
    return float(sum(r.job.gpus * r.productive for r in runs) / wall) if wall > 0 else 1.0
