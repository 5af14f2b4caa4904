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
from gpuyard.scheduler.placement import ClusterState, NodeSpec, Placement, place
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
        elastic_alpha: how an elastic job's speed scales with its GPUs (``(g / g0) ** alpha``).
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
    resized_at: float = -math.inf
    productive: float = 0.0  # wall seconds whose progress was kept (at its speed, on its placement)
    lost_gpu_s: float = 0.0  # GPU-seconds held without kept progress: restarts, lost work, stalls
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
        elastic: job id -> (min, max) GPUs of the jobs that may grow and shrink. Such a job is queued
            at its minimum; when nothing waits it grows into idle GPUs (the job with the most work
            left first), and it shrinks toward its minimum so that the first queued job can start.
            A resize is a checkpoint on demand (no work lost) and a restart at the new size; a job
            is resized at most once per ``preempt_check_s``.

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
    for jid, (low, high) in (elastic or {}).items():
        if jid in runs:
            if not 1 <= low <= high:
                raise ConfigError(f"elastic job {jid}: bounds {low}..{high} are not 1 <= min <= max")
            runs[jid].bounds = (low, min(high, total))
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

    def start(run: _Run, placement: Placement, at: float, estimate: float) -> None:
        """Run ``run`` on ``placement`` from ``at``: its end (or failure) event goes on the heap."""
        state.take(placement)
        run.alloc = placement.gpus
        run.started_at, run.version = at, run.version + 1
        speed = _speed(run, config)
        running[run.job.id] = RunningJob(
            run.job.id,
            run.alloc,
            run.job.team,
            run.job.priority,
            at,
            at + max(estimate, 1.0) * run.ratio / speed,
            placement,
            attained=run.attained,
        )
        end = at + run.overhead + run.remaining * run.ratio * config.stall_factor / speed
        fail = _failure_time(config, run.alloc, at, rng)
        heapq.heappush(ends, (min(end, fail), run.job.id, run.version, fail < end))

    def resize(run: _Run, gpus: int, at: float) -> bool:
        """Checkpoint ``run`` on demand and restart it on ``gpus`` GPUs (False: no room, nothing done)."""
        held = running[run.job.id]
        state.release(held.placement)
        placement = place(state, gpus, held.gpu_type)
        if placement is None:
            state.take(held.placement)
            return False
        del running[run.job.id]
        _stop(run, at, config, keep_all=True)
        run.resizes, run.resized_at = run.resizes + 1, at
        start(run, placement, at, run.remaining)
        return True

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
            _account(run, now - run.started_at, run.remaining, config)
            run.finish = now
            estimator.observe(run.job.team, run.job.user, run.job.gpus, run.job.duration)
        while nxt < len(arrivals) and arrivals[nxt].job.submit <= now:
            queue.add(_queued(arrivals[nxt], estimator, now, workloads))
            nxt += 1
        if queue and elastic:
            _shrink_for_first(queue, _resizable(runs, running, now, config), state.free_gpus, now, resize)
        if queue:
            check = policy.preemptive and now >= next_check
            if state.free_gpus >= queue.min_gpus() or check:
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
                    if math.isnan(run.first_start):
                        run.first_start = now
                    # An oracle policy knows the true remaining time of what runs (srtf-oracle
                    # preempts by it); every other policy sees the history estimate.
                    expect = run.remaining if policy.needs_oracle else qjob.estimate - qjob.attained
                    start(run, placement, now, expect)
        if elastic and not queue and state.free_gpus:
            _grow(_resizable(runs, running, now, config), state, now, config, resize)
    result = _result(policy.name, list(runs.values()), len(trace) - len(runs), total, preemptions)
    result.fabric_waits, result.failures = len(waited), failures
    result.elastic_jobs = sum(r.bounds is not None for r in runs.values())
    result.resizes = sum(r.resizes for r in runs.values())
    return result


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


def _resizable(
    runs: dict[int, _Run], running: dict[int, RunningJob], now: float, config: SimConfig
) -> list[tuple[_Run, int, int]]:
    """The running elastic jobs a resize may touch now (none twice within ``preempt_check_s``),
    each with its (min, max) GPUs."""
    out = []
    for jid in running:
        run = runs[jid]
        if run.bounds is not None and now - run.resized_at >= config.preempt_check_s:
            out.append((run, *run.bounds))
    return out


def _shrink_for_first(
    queue: JobQueue, elastic: list[tuple[_Run, int, int]], free: int, now: float, resize: Any
) -> None:
    """Shrink elastic jobs toward their minimum (largest first) when that lets the first queued job start."""
    need = next(queue.ordered()).gpus - free
    spare = [(run, run.alloc - low) for run, low, _ in elastic if run.alloc > low]
    if need <= 0 or sum(give for _, give in spare) < need:
        return  # it fits already, or shrinking all of them would not be enough: keep them as they are
    for run, give in sorted(spare, key=lambda rg: (-rg[0].alloc, rg[0].job.id)):
        if need <= 0:
            break
        give = min(give, need)
        if resize(run, run.alloc - give, now):
            need -= give


def _grow(
    elastic: list[tuple[_Run, int, int]], state: ClusterState, now: float, config: SimConfig, resize: Any
) -> None:
    """Nothing waits: give idle GPUs to elastic jobs below their maximum, most work left first.

    A job grows only when its work left is worth the restart: more than ten restarts' time.
    """
    worth = [(run, high) for run, _, high in elastic if run.remaining > 10 * config.restart_overhead_s]
    for run, high in sorted(worth, key=lambda rh: (-rh[0].remaining, rh[0].job.id)):
        more = min(high - run.alloc, state.free_gpus)
        if state.free_gpus <= 0:
            break
        if more > 0:
            resize(run, run.alloc + more, now)


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
    _stop(run, now, config, keep_all=False)
    if failed:
        run.failures += 1
    else:
        run.preemptions += 1
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
