"""Scheduling policies: pure functions from (cluster state, queue, running jobs, now) to a Decision.

A policy never changes what it is given: it places jobs on a copy of the free slots and returns what
to start and what to preempt; the server and the simulator carry the decision out. Each policy also
gives the key that orders its queue (:class:`JobQueue` keeps jobs in that order as they arrive).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.scheduler.fabric_placement import FabricPass, FabricPlacer
from gpuyard.scheduler.placement import ClusterState, Placement, place
from gpuyard.scheduler.queue import Decision, JobQueue, QueuedJob, RunningJob


class Policy:
    """Base policy: greedy in key order, skipping jobs that do not fit now."""

    name = "greedy"
    summary = ""
    needs_oracle = False  # uses true run times (simulator only)
    preemptive = False
    # Fabric-aware placement for jobs with a workload (None: topology-aware placement only).
    placer: FabricPlacer | None = None

    def _fabric(self, running: Sequence[RunningJob], now: float) -> FabricPass | None:
        return FabricPass(self.placer, list(running), now) if self.placer is not None else None

    def key(self, job: QueuedJob) -> Any:
        """Sort key of a queued job (smaller runs first)."""
        return (job.submit_time, job.id)

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Choose jobs to start now (greedy: every job that fits, in key order)."""
        work, fab = state.copy(), self._fabric(running, now)
        starts = _greedy(work, queue.ordered(), queue.min_gpus(), multi_node, blocking=False, fabric=fab)
        return Decision(starts=starts, waits=_waits(fab))


def _try(
    work: ClusterState, job: QueuedJob, multi_node: bool, fabric: FabricPass | None = None
) -> Placement | None:
    drained = work.drained
    if job.avoid:  # nodes this job must not use: drained for its own placement only
        work.drain_more(job.avoid)
    try:
        if fabric is None or job.share is not None:  # shares and MIG slices: no fabric cost to weigh
            placement = place(work, job.gpus, job.gpu_type, job.cpus, multi_node, share=job.share)
        else:
            placement = fabric.place(work, job, multi_node)
    finally:
        work.drained = drained
    if placement is not None:
        work.take(placement)
        if fabric is not None and job.share is None:
            fabric.started(job, placement)
    return placement


def _waits(fabric: FabricPass | None) -> dict[int, str]:
    return fabric.waits if fabric is not None else {}


def _greedy(
    work: ClusterState,
    jobs: Iterable[QueuedJob],
    min_gpus: int,
    multi_node: bool,
    blocking: bool,
    fabric: FabricPass | None = None,
) -> list[tuple[QueuedJob, Placement]]:
    starts: list[tuple[QueuedJob, Placement]] = []
    free = work.free_gpus
    for job in jobs:
        if free < min_gpus:
            break  # nothing left in the queue can fit
        placement = _try(work, job, multi_node, fabric) if job.gpus <= free else None
        if placement is None:
            if blocking:
                break
            continue
        starts.append((job, placement))
        free -= job.gpus
    return starts


class Fifo(Policy):
    """First in, first out; the head job blocks everything behind it."""

    name = "fifo"
    summary = "first in, first out; the oldest job blocks the queue until it fits"

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Start jobs in arrival order until one does not fit (or waits for a consolidated placement)."""
        work, fab = state.copy(), self._fabric(running, now)
        starts = _greedy(work, queue.ordered(), queue.min_gpus(), multi_node, blocking=True, fabric=fab)
        return Decision(starts=starts, waits=_waits(fab))


def _shadow(
    job: QueuedJob, work: ClusterState, running: Iterable[RunningJob], now: float
) -> tuple[float, int]:
    """When the blocked job could start if running jobs end as expected, and GPUs spare at that time."""
    mask = work.type_mask(job.gpu_type)
    avail = int(work.free.sum() if mask is None else work.free[mask].sum())
    for r in sorted(running, key=lambda r: r.expected_end):
        if job.gpu_type and r.gpu_type and r.gpu_type != job.gpu_type:
            continue
        avail += r.gpus
        if avail >= job.gpus:
            # A job that overran its estimate is expected to end soon, not in the past.
            return max(r.expected_end, now + 1.0), avail - job.gpus
    return math.inf, 0


class PriorityBackfill(Policy):
    """Highest priority first; later jobs backfill only where they cannot delay the first blocked job.

    The first job that does not fit gets a reservation (EASY backfilling): the time its GPUs free up
    if running jobs end as estimated. A later job may start now only if it is expected to end by then,
    or if it uses GPUs beyond what the reserved job needs at that time.
    """

    name = "priority"
    summary = "highest priority first, backfill behind a reservation for the first blocked job"

    def key(self, job: QueuedJob) -> Any:
        """Priority (high first), then arrival."""
        return (-job.priority, job.submit_time, job.id)

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Start jobs by priority; backfill behind one reservation."""
        work, fab = state.copy(), self._fabric(running, now)
        starts: list[tuple[QueuedJob, Placement]] = []
        reservation: tuple[int, float] | None = None
        extra = 0
        free, min_gpus = work.free_gpus, queue.min_gpus()
        for job in queue.ordered():
            if free < min_gpus:
                break
            if job.gpus > free:
                placement = None
            elif reservation is not None and now + job.estimate > reservation[1] and job.gpus > extra:
                continue  # would still hold GPUs the reserved job needs when it is due to start
            else:
                before = work.free_gpus if job.share is not None else 0
                placement = _try(work, job, multi_node, fab)
            if placement is None:
                if reservation is None:
                    started = [_as_running(j, p, now) for j, p in starts]
                    shadow, extra = _shadow(job, work, [*running, *started], now)
                    reservation = (job.id, shadow)
                continue
            # Whole GPUs it took: its GPUs, or for a share 1 when it opened a free GPU (else 0).
            took = before - work.free_gpus if job.share is not None else job.gpus
            if reservation is not None and now + job.estimate > reservation[1]:
                if took > extra:  # a share that opens a GPU the reserved job needs: not now
                    work.release(placement)
                    continue
                extra -= took
            starts.append((job, placement))
            free -= took
        return Decision(starts=starts, reservation=reservation, waits=_waits(fab))


def _stopping_gpus(running: Iterable[RunningJob]) -> int:
    """GPUs of jobs already told to stop: they free up without another victim (any GPU type)."""
    return sum(r.gpus for r in running if r.stopping)


def _as_running(job: QueuedJob, placement: Placement, now: float) -> RunningJob:
    return RunningJob(
        job.id, job.gpus, job.team, job.priority, now, now + job.estimate, placement, job.gpu_type
    )


class ShortestExpectedFirst(Policy):
    """Shortest expected run time first, the expectation learnt from history (no oracle)."""

    name = "sef"
    summary = "shortest expected run time first, estimated from finished jobs (team, user, size)"

    def key(self, job: QueuedJob) -> Any:
        """Remaining expected run time, then arrival."""
        return (max(job.estimate - job.attained, 1.0), job.submit_time, job.id)


class LeastAttainedService(Policy):
    """Least attained service first (discretized, preemptive; Tiresias' 2D-LAS), ties by expected run time.

    A job's level is set by the GPU-seconds it has received so far: every job starts at the top, and
    sinks as it runs. Queued jobs of a higher level preempt running jobs of a lower one. Run times in
    clusters are heavy-tailed, so a job that has run long is likely to run much longer: LAS approaches
    shortest-remaining-first without knowing run times, and history breaks ties within a level.
    """

    name = "las"
    summary = "least attained GPU-service first, preemptive (Tiresias-like), history breaks ties"
    preemptive = True

    def __init__(
        self,
        thresholds: tuple[float, ...] = (3600.0 * 4, 3600.0 * 64),
        min_run_s: float = 600.0,
        max_preempt: int = 8,
    ) -> None:
        self.thresholds = thresholds  # GPU-seconds at which a job sinks one level
        self.min_run_s = min_run_s  # a (re)started job keeps its GPUs at least this long
        self.max_preempt = max_preempt  # victims per decision, so one burst cannot flush the cluster

    def level(self, gpu_seconds: float) -> int:
        """Queue level of a job that has received ``gpu_seconds``."""
        level = 0
        for t in self.thresholds:
            if gpu_seconds < t:
                break
            level += 1
        return level

    def key(self, job: QueuedJob) -> Any:
        """Level, then expected remaining run time, then arrival."""
        return (self.level(job.attained * job.gpus), max(job.estimate - job.attained, 1.0), job.submit_time)

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Start what fits in key order; then let waiting jobs preempt lower-level running jobs."""
        work, fab = state.copy(), self._fabric(running, now)
        starts = _greedy(work, queue.ordered(), queue.min_gpus(), multi_node, blocking=False, fabric=fab)
        waits = _waits(fab)
        if not preempt or len(starts) == len(queue):
            return Decision(starts=starts, waits=waits)
        started = {j.id for j, _ in starts}
        waiting = next((j for j in queue.ordered() if j.id not in started), None)
        top = self.level(waiting.attained * waiting.gpus) if waiting is not None else len(self.thresholds)
        if top >= len(self.thresholds):
            # The best waiting job is at the bottom level: no one is below it.
            return Decision(starts=starts, waits=waits)
        bar = self.thresholds[top]  # running jobs past this many GPU-seconds sit at a lower level
        victims = sorted(
            (
                (self.level(gs), r)
                for r in running
                if not r.stopping
                and now - r.started_at >= self.min_run_s
                and (gs := (r.attained + now - r.started_at) * r.gpus) >= bar
            ),
            key=lambda lr: (-lr[0], -lr[1].started_at),
        )
        chosen_ids: list[int] = []
        spare = work.free_gpus + _stopping_gpus(running)
        for job in queue.ordered():
            if not victims or len(chosen_ids) >= self.max_preempt:
                break
            if job.id in started:
                continue
            lvl = self.level(job.attained * job.gpus)
            got, chosen = spare, 0
            while got < job.gpus and chosen < len(victims) and victims[chosen][0] > lvl:
                got += victims[chosen][1].gpus
                chosen += 1
            if got < job.gpus:
                break  # later jobs are of the same or a lower level: nobody below them either
            chosen_ids.extend(r.id for _, r in victims[:chosen])
            victims = victims[chosen:]
            spare = got - job.gpus
        return Decision(starts=starts, preempt=chosen_ids, waits=waits)


class SjfOracle(Policy):
    """Shortest job first with the true run times: a reference only the simulator can run."""

    name = "sjf-oracle"
    summary = "shortest job first with true run times (simulator reference; needs an oracle)"
    needs_oracle = True

    def key(self, job: QueuedJob) -> Any:
        """True remaining run time, then arrival."""
        duration = job.duration if job.duration is not None else job.estimate
        return (duration - job.attained, job.submit_time, job.id)


class SrtfOracle(Policy):
    """Preemptive shortest remaining time first with the true run times: the simulator's reference.

    The queue is ordered by true remaining run time. What fits starts; then a waiting job preempts the
    running jobs whose true remaining time is longer than its own by more than ``margin_s`` (the
    longest first), so that it starts now. The simulator charges every preemption as it charges any
    other (work since the last checkpoint lost, a restart overhead), so ``margin_s`` keeps the oracle
    from swapping jobs whose remaining times are too close for a swap to pay off. Not an exact lower
    bound on JCT (multi-GPU SRTF is not optimal, and preemptions cost), but the strongest reference
    with run times known: it preempts where LAS can only guess. The defaults (a job keeps its GPUs an
    hour, a victim has an hour more work left, up to 64 victims a decision) are the best of the few
    settings tried on the Philly replay of benchmarks/simulator.py (BENCHMARKS.md): the reference is
    taken in its strongest configuration found, not a weak one.
    """

    name = "srtf-oracle"
    summary = "preemptive shortest remaining time first with true run times (simulator reference)"
    needs_oracle = True
    preemptive = True

    def __init__(self, min_run_s: float = 3600.0, margin_s: float = 3600.0, max_preempt: int = 64) -> None:
        self.min_run_s = min_run_s  # a (re)started job keeps its GPUs at least this long
        self.margin_s = margin_s  # a victim must have this much more work left than the waiting job
        self.max_preempt = max_preempt  # victims per decision

    @staticmethod
    def remaining(job: QueuedJob) -> float:
        """True remaining run time of a queued job (its estimate where the truth is not given)."""
        duration = job.duration if job.duration is not None else job.estimate
        return max(duration - job.attained, 0.0)

    def key(self, job: QueuedJob) -> Any:
        """True remaining run time, then arrival."""
        return (self.remaining(job), job.submit_time, job.id)

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Start what fits, shortest remaining first; then preempt jobs with much more work left.

        A running job's remaining time is ``expected_end - now``: the simulator starts an oracle
        policy's jobs with their true remaining run time as the estimate.
        """
        work, fab = state.copy(), self._fabric(running, now)
        starts = _greedy(work, queue.ordered(), queue.min_gpus(), multi_node, blocking=False, fabric=fab)
        waits = _waits(fab)
        if not preempt or len(starts) == len(queue):
            return Decision(starts=starts, waits=waits)
        started = {j.id for j, _ in starts}
        victims = sorted(
            (r for r in running if not r.stopping and now - r.started_at >= self.min_run_s),
            key=lambda r: (-(r.expected_end - now), -r.started_at),
        )
        chosen_ids: list[int] = []
        spare = work.free_gpus + _stopping_gpus(running)
        for job in queue.ordered():
            if not victims or len(chosen_ids) >= self.max_preempt:
                break
            if job.id in started:
                continue
            bar = self.remaining(job) + self.margin_s
            longer = [
                r
                for r in victims
                if r.expected_end - now > bar
                and not (job.gpu_type and r.gpu_type and r.gpu_type != job.gpu_type)
            ]
            got = spare
            chosen: list[RunningJob] = []
            for r in longer:
                if got >= job.gpus or len(chosen_ids) + len(chosen) >= self.max_preempt:
                    break
                chosen.append(r)
                got += r.gpus
            if got < job.gpus:
                continue  # not enough longer jobs to free its GPUs: a smaller job later may still fit
            chosen_ids.extend(r.id for r in chosen)
            taken = {r.id for r in chosen}
            victims = [r for r in victims if r.id not in taken]
            spare = got - job.gpus
        return Decision(starts=starts, preempt=chosen_ids, waits=waits)


class FifoBackfill(PriorityBackfill):
    """FIFO with EASY backfilling: arrival order; later jobs backfill behind the first blocked job.

    The first job that does not fit gets a reservation at the time its GPUs free up if running jobs
    end as estimated (estimates from finished jobs' history, as a real scheduler has them); a later
    job starts now only if it cannot delay that reservation (Lifka's EASY, as in Slurm's backfill).
    """

    name = "fifo-backfill"
    summary = "first in, first out with EASY backfill behind a reservation for the first blocked job"

    def key(self, job: QueuedJob) -> Any:
        """Arrival."""
        return (job.submit_time, job.id)


class FairShare(Policy):
    """Fair share across teams with weighted quotas; idle quota is lent out and reclaimed by preemption.

    A team's share is its weight over the weights of the teams that have work, times the cluster's
    GPUs. Jobs start team by team, always from the team furthest below its share; a team may go over
    its share while others leave GPUs idle. When a team under its share has a job that does not fit,
    jobs of teams over their share are preempted (the most recently started first: least work lost).
    """

    name = "fair"
    summary = "weighted fair share across teams; idle GPUs lent, reclaimed by preemption"
    preemptive = True

    def __init__(
        self, weights: dict[str, float] | None = None, min_run_s: float = 300.0, min_wait_s: float = 60.0
    ) -> None:
        self.weights = dict(weights or {})
        self.min_run_s = min_run_s  # a job runs at least this long before it can be preempted
        self.min_wait_s = min_wait_s  # a job waits at least this long before it preempts anyone

    def key(self, job: QueuedJob) -> Any:
        """Within a team: priority, then arrival."""
        return (-job.priority, job.submit_time, job.id)

    def shares(self, state: ClusterState, teams: Iterable[str]) -> dict[str, float]:
        """GPUs each active team deserves now."""
        active = set(teams)
        total_w = sum(self.weights.get(t, 1.0) for t in active) or 1.0
        return {t: state.total_gpus * self.weights.get(t, 1.0) / total_w for t in active}

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        """Start jobs from the most under-served team first, then preempt to reclaim lent GPUs."""
        work, fab = state.copy(), self._fabric(running, now)
        usage: dict[str, int] = {}
        for r in running:
            usage[r.team] = usage.get(r.team, 0) + r.gpus
        share = self.shares(state, [*usage, *queue.teams])
        starts: list[tuple[QueuedJob, Placement]] = []
        blocked: dict[str, QueuedJob] = {}
        iters = {t: iter(queue.team_jobs(t)) for t in queue.teams}
        heap = [(usage.get(t, 0) / share[t], t) for t in iters]
        heapq.heapify(heap)
        free, min_gpus = work.free_gpus, queue.min_gpus()
        while heap and free >= min_gpus:
            _, team = heapq.heappop(heap)
            for job in iters[team]:
                placement = _try(work, job, multi_node, fab) if job.gpus <= free else None
                if placement is not None:
                    starts.append((job, placement))
                    free -= job.gpus
                    usage[team] = usage.get(team, 0) + job.gpus
                    heapq.heappush(heap, (usage[team] / share[team], team))
                    break
                blocked.setdefault(team, job)
        for team, rest in iters.items():
            # Teams the pass never reached (the cluster is full) may still be owed GPUs.
            if team not in blocked:
                nxt = next(rest, None)
                if nxt is not None:
                    blocked[team] = nxt
        if not preempt:
            return Decision(starts=starts, waits=_waits(fab))
        victims = self._reclaim(work, blocked, usage, share, running, now)
        return Decision(starts=starts, preempt=victims, waits=_waits(fab))

    def _reclaim(
        self,
        work: ClusterState,
        blocked: dict[str, QueuedJob],
        usage: dict[str, int],
        share: dict[str, float],
        running: Sequence[RunningJob],
        now: float,
    ) -> list[int]:
        victims: list[int] = []
        taken: set[int] = set()
        spare = work.free_gpus + _stopping_gpus(running)
        for r in running:
            if r.stopping:  # on its way out: its team no longer counts it (nor loses it twice)
                usage[r.team] -= r.gpus
        for team, job in sorted(blocked.items(), key=lambda kv: usage.get(kv[0], 0) / share[kv[0]]):
            if usage.get(team, 0) + job.gpus > share[team] or now - job.enqueued_at < self.min_wait_s:
                continue  # only a team within its quota reclaims, and only after a short wait
            candidates = sorted(
                (
                    r
                    for r in running
                    if r.id not in taken
                    and not r.stopping
                    and r.team != team
                    and usage.get(r.team, 0) > share.get(r.team, 0.0)
                    and now - r.started_at >= self.min_run_s
                    and not (job.gpu_type and r.gpu_type and r.gpu_type != job.gpu_type)
                ),
                key=lambda r: (-(usage[r.team] - share[r.team]), -r.started_at),
            )
            chosen, got, tentative = [], spare, dict(usage)
            for r in candidates:
                if got >= job.gpus:
                    break
                if tentative[r.team] <= share[r.team]:
                    continue  # never push a team below its own share
                chosen.append(r)
                got += r.gpus
                tentative[r.team] -= r.gpus
            if got >= job.gpus:  # spare GPUs alone may cover it: they are then spent on it
                usage.update(tentative)
                taken.update(r.id for r in chosen)
                victims.extend(r.id for r in chosen)
                spare = got - job.gpus
                usage[team] = usage.get(team, 0) + job.gpus
        return victims


PolicyFactory = Callable[..., Policy]
POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        Fifo,
        FifoBackfill,
        PriorityBackfill,
        FairShare,
        ShortestExpectedFirst,
        LeastAttainedService,
        SjfOracle,
        SrtfOracle,
    )
}


def make_policy(
    name: str,
    weights: dict[str, float] | None = None,
    allow_oracle: bool = True,
    min_run_s: float | None = None,
    placer: FabricPlacer | None = None,
) -> Policy:
    """The policy called ``name`` (see ``POLICIES``).

    Args:
        name: policy name.
        weights: team quotas for ``fair``.
        allow_oracle: False where true run times are unknown (the server).
        min_run_s: for preemptive policies, how long a job keeps its GPUs before it may be preempted.
        placer: fabric-aware placement for jobs with a workload (None: topology-aware placement only).

    Raises:
        ConfigError: unknown name, or an oracle policy where true run times are unknown.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"policy {name!r} is unknown; choose one of {', '.join(POLICIES)}")
    if cls.needs_oracle and not allow_oracle:
        raise ConfigError(f"policy {name!r} needs true run times; only the simulator can run it")
    policy: Policy
    if cls is FairShare:
        policy = (
            FairShare(weights) if min_run_s is None else FairShare(weights, min_run_s, min(min_run_s, 60.0))
        )
    elif cls is LeastAttainedService and min_run_s is not None:
        policy = LeastAttainedService(min_run_s=min_run_s)
    elif cls is SrtfOracle and min_run_s is not None:
        policy = SrtfOracle(min_run_s=min_run_s)
    else:
        policy = cls()
    policy.placer = placer
    return policy
