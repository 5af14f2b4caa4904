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

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.scheduler.estimator import RuntimeEstimator
from gpuyard.scheduler.fabric_placement import FabricPlacer, shape_of
from gpuyard.scheduler.placement import ClusterState, NodeSpec, Placement
from gpuyard.scheduler.policies import Policy
from gpuyard.scheduler.queue import JobQueue, QueuedJob, RunningJob
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

    @property
    def stall_factor(self) -> float:
        """Wall time per second of work: each checkpoint interval also pays the checkpoint's stall."""
        return 1.0 + self.checkpoint_stall_s / self.checkpoint_interval_s


@dataclass
class _Run:
    job: TraceJob
    remaining: float  # work left, seconds
    first_start: float = math.nan
    finish: float = math.nan
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
    # GPU-weighted effective training time ratio: the work of the trace over the time from each job's
    # first start to its end (restarts, requeue waits after failures, lost work and slowdowns count
    # against it; the first queueing does not).
    ettr: float = 1.0
    lost_gpu_hours: float = 0.0  # GPU time held without progress kept (work lost + restart overheads)

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
) -> SimResult:
    """Replay ``trace`` on ``nodes`` under ``policy``.

    Jobs larger than the whole cluster are counted as rejected (the server refuses them at submit).

    Args:
        trace: the jobs.
        nodes: the virtual cluster.
        policy: the scheduling policy (its ``placer`` set for fabric-aware placement).
        config: preemption costs.
        workloads: job id -> ``gpuyard.fabric.placement_cost.Workload``; jobs of this map run slower
            on placements the fabric model predicts slower than their consolidated one.
        fabric: the fabric cluster of ``nodes`` (needed with ``workloads``).

    Raises:
        CapacityError: no job of the trace fits on the cluster.
        ConfigError: workloads without a fabric cluster.
    """
    config = config or SimConfig()
    workloads = workloads or {}
    if workloads and fabric is None:
        raise ConfigError("simulating workloads needs the fabric cluster of the nodes")
    costs = FabricPlacer(fabric) if workloads else None
    state = ClusterState(nodes)
    total = state.total_gpus
    runs = {j.id: _Run(j, j.duration) for j in trace if 0 < j.gpus <= total}
    if not runs:
        raise CapacityError(f"no job of the trace fits on {total} GPUs")
    arrivals = sorted(runs.values(), key=lambda r: (r.job.submit, r.job.id))
    queue = JobQueue(policy.key)
    estimator = RuntimeEstimator()
    running: dict[int, RunningJob] = {}
    # (time, job id, version, failed): lazy deletion on preemption; failed: a failure, not the end
    ends: list[tuple[float, int, int, bool]] = []
    rng = np.random.default_rng(config.failure_seed)
    preemptions, failures, nxt, next_check = 0, 0, 0, 0.0
    waited: set[int] = set()
    now = 0.0
    while nxt < len(arrivals) or ends:
        now = min(
            arrivals[nxt].job.submit if nxt < len(arrivals) else math.inf, ends[0][0] if ends else math.inf
        )
        while ends and ends[0][0] <= now:
            _, jid, version, failed = heapq.heappop(ends)
            run = runs[jid]
            if version != run.version:
                continue
            if failed:
                failures += 1
                _preempt(run, running.pop(jid), state, queue, estimator, now, config, workloads, failed=True)
                continue
            state.release(running.pop(jid).placement)
            run.busy += now - run.started_at
            run.finish = now
            estimator.observe(run.job.team, run.job.user, run.job.gpus, run.job.duration)
        while nxt < len(arrivals) and arrivals[nxt].job.submit <= now:
            queue.add(_queued(arrivals[nxt], estimator, now, workloads))
            nxt += 1
        if not queue:
            continue
        check = policy.preemptive and now >= next_check
        if state.free_gpus < queue.min_gpus() and not check:
            continue
        if check:
            next_check = now + config.preempt_check_s
        decision = policy.decide(state, queue, list(running.values()), now, preempt=check)
        waited.update(decision.waits)
        for jid in decision.preempt:
            preemptions += 1
            _preempt(runs[jid], running.pop(jid), state, queue, estimator, now, config, workloads)
        for qjob, placement in decision.starts:
            queue.remove(qjob.id)
            run = runs[qjob.id]
            _slowdown(run, placement, state, costs, workloads.get(qjob.id))
            state.take(placement)
            if math.isnan(run.first_start):
                run.first_start = now
            run.started_at, run.version = now, run.version + 1
            running[qjob.id] = RunningJob(
                qjob.id,
                qjob.gpus,
                qjob.team,
                qjob.priority,
                now,
                now + max(qjob.estimate - qjob.attained, 1.0) * run.ratio,
                placement,
                attained=qjob.attained,
            )
            end = now + run.remaining * run.ratio * config.stall_factor
            fail = _failure_time(config, qjob.gpus, now, rng)
            heapq.heappush(ends, (min(end, fail), qjob.id, run.version, fail < end))
    result = _result(policy.name, list(runs.values()), len(trace) - len(runs), total, preemptions)
    result.fabric_waits, result.failures = len(waited), failures
    return result


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
        gpus=j.gpus,
        team=j.team,
        user=j.user,
        priority=j.priority,
        submit_time=j.submit,
        estimate=estimator.estimate(j.team, j.user, j.gpus),
        duration=run.remaining + run.attained,
        attained=run.attained,
        enqueued_at=now,
        workload=workloads.get(j.id),
    )


def _preempt(
    run: _Run,
    held: RunningJob,
    state: ClusterState,
    queue: JobQueue,
    estimator: RuntimeEstimator,
    now: float,
    config: SimConfig,
    workloads: dict[int, Any],
    failed: bool = False,
) -> None:
    """Stop a running job (preempted, or ``failed``): it keeps the work of its last checkpoint."""
    state.release(held.placement)
    ran = now - run.started_at
    run.busy += ran
    # A resumed attempt spends its first restart_overhead_s restarting, not progressing.
    overhead = config.restart_overhead_s if run.preemptions + run.failures else 0.0
    # Work, in seconds on the consolidated placement without checkpoint stalls.
    progress = max(0.0, ran - overhead) / (run.ratio * config.stall_factor)
    saved = progress - progress % config.checkpoint_interval_s
    # The restart this attempt began with is spent, finished or not; the next attempt pays its own.
    run.remaining = run.remaining - overhead - saved + config.restart_overhead_s
    run.attained += saved
    if failed:
        run.failures += 1
    else:
        run.preemptions += 1
    run.version += 1  # its pending completion event no longer counts
    queue.add(_queued(run, estimator, now, workloads))


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
        lost_gpu_hours=float(sum(r.job.gpus * max(0.0, r.busy - r.job.duration) for r in runs) / 3600.0),
        multi_node_jobs=sum(r.multi_node for r in runs),
        multi_leaf_jobs=sum(r.multi_leaf for r in runs),
        slowed_jobs=sum(r.slowed for r in runs),
    )


def _ettr(runs: list[_Run]) -> float:
    """GPU-weighted work / (end - first start): what failures, restarts and slowdowns cost the jobs."""
    wall = sum(r.job.gpus * (r.finish - r.first_start) for r in runs)
    return float(sum(r.job.gpus * r.job.duration for r in runs) / wall) if wall > 0 else 1.0
