"""Predicted start and end of queued and running jobs: the scheduler run forward on a virtual clock.

Each job's run time comes from the best source it has, named in the prediction's ``basis``:

- ``step_model``: its workload declares ``steps``; the fabric step model's step time on the job's
  consolidated placement times its steps (range: what the step model's largest error on the
  published corpus, ``STEP_MODEL_ERROR``, allows the true run time to be).
- ``history``: finished runs of like jobs (same user and job name): their median, p10-p90 as the range
  (min-max under three runs), capped by its time limit when it has one.
- ``time_limit``: its time limit, an upper bound (users over-estimate), the range down to a tenth of it.
- ``unknown``: none of these. Such a job has no end; the jobs its GPUs hold back have no start.

Jobs with a history of failures or preemptions (like jobs restarted on average ``r`` times) pay
``r`` restarts (the simulator's restart overhead plus half its checkpoint interval of lost work).

The live state (running jobs with what they have run, queued jobs in the policy's order) goes through
:func:`gpuyard.scheduler.simulator.simulate` three times: point run times, every run time at the low
end of its range (unknown: ending at once), every one at the high end (unknown: never ending). A job's
start and end are the point run's; its ranges span the three. The policy is wrapped to record when it
starts and preempts each job (:class:`_Recorder`); nothing of the simulator's inside is reached into.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from pydantic import ValidationError
from sqlalchemy import func, select

from gpuyard.errors import CapacityError
from gpuyard.scheduler.core import JobView, PlacedPart, task_shapes
from gpuyard.scheduler.placement import (
    ClusterState,
    GpuShare,
    NodeSpec,
    Placement,
    SharePart,
    share_never_fits,
    share_of,
)
from gpuyard.scheduler.policies import Policy
from gpuyard.scheduler.queue import Decision, JobQueue, QueuedJob, RunningJob
from gpuyard.scheduler.simulator import SimConfig, simulate
from gpuyard.scheduler.spec import JobSpec, JobState
from gpuyard.scheduler.trace import TraceJob

log = logging.getLogger(__name__)

# The step model's largest leave-one-source-out error on the published corpus, as predicted /
# published - 1 (gpuyard.fabric.accuracy.RunError.error): loso_max_pct=56.8 in BENCHMARKS.md's
# fabric_accuracy table, its latest row (2026-11-29, benchmarks/fabric_accuracy.py; the worst row is a
# Megatron-Bridge 25.11 MoE one). With |error| <= e the published time is within predicted / (1 + e) ..
# predicted / (1 - e): a step-model run time spans /1.57 .. x2.31 (estimate_run_time).
STEP_MODEL_ERROR = 0.568
LIMIT_LOW = 0.1  # a job with only a time limit may end this early (a tenth of its limit)
HORIZON_S = 10 * 365 * 86400.0  # "never ends" in the forward run; anything past half of it is unknown
QUEUE_AT_S = 1e-3  # queued jobs enter the forward run just after the running ones have been placed
CACHE_S = 10.0  # predictions are reused this long while the queue has not changed
PENDING = (JobState.QUEUED.value, JobState.PREEMPTED.value)
HOLDING = (JobState.SCHEDULED.value, JobState.RUNNING.value)


@dataclass(frozen=True)
class RunTime:
    """A job's expected run time in seconds (point and range), and where it came from."""

    point: float | None
    low: float | None
    high: float | None
    basis: str
    note: str = ""

    @classmethod
    def unknown(cls, note: str) -> RunTime:
        """No source: no point and no range."""
        return cls(None, None, None, "unknown", note)

    @property
    def known(self) -> bool:
        """Whether there is a run time at all."""
        return self.point is not None


@dataclass(frozen=True)
class LikeRuns:
    """Finished runs of jobs like one job: run seconds of each, and restarts (failures + preemptions)."""

    durations: tuple[float, ...]
    restarts: tuple[int, ...] = ()

    @property
    def mean_restarts(self) -> float:
        """Restarts per job, on average."""
        return float(np.mean(self.restarts)) if self.restarts else 0.0


class History:
    """Finished runs by (user, job name), learned from the store's succeeded jobs."""

    def __init__(self, runs: dict[tuple[str, str], LikeRuns] | None = None) -> None:
        self.runs = runs or {}

    def like(self, user: str, name: str) -> LikeRuns | None:
        """Runs of jobs with this user and name, or None."""
        return self.runs.get((user, name))

    @classmethod
    def from_rows(cls, rows: Iterable[Any]) -> History:
        """From finished job rows (``user``, ``name``, ``attained_s``, ``failures``, ``preemptions``)."""
        acc: dict[tuple[str, str], tuple[list[float], list[int]]] = {}
        for r in rows:
            if r.attained_s and r.attained_s > 0:
                durations, restarts = acc.setdefault((r.user, r.name), ([], []))
                durations.append(float(r.attained_s))
                restarts.append(int(r.failures or 0) + int(r.preemptions or 0))
        return cls({k: LikeRuns(tuple(d), tuple(r)) for k, (d, r) in acc.items()})


def restart_cost_s(config: SimConfig) -> float:
    """What one failure or preemption costs a job: the restart, and half a checkpoint interval of work."""
    return config.restart_overhead_s + config.checkpoint_interval_s / 2


def estimate_run_time(
    time_limit_s: float | None,
    like: LikeRuns | None,
    steps: int | None = None,
    step_s: float | None = None,
    config: SimConfig | None = None,
) -> RunTime:
    """A job's run time from its best source (see the module docstring)."""
    config = config or SimConfig()
    extra = like.mean_restarts * restart_cost_s(config) if like is not None else 0.0
    restarts = f", {like.mean_restarts:.1f} restarts expected" if like is not None and extra else ""
    if steps and step_s:
        point = steps * step_s
        note = f"{steps} steps of {step_s:.3g} s (fabric step model){restarts}"
        low, high = point / (1 + STEP_MODEL_ERROR), point / (1 - STEP_MODEL_ERROR)
        return RunTime(point + extra, low, high + extra, "step_model", note)
    if like is not None and like.durations:
        d = np.asarray(like.durations)
        point = float(np.median(d))
        if d.size >= 3:
            low, high = (float(x) for x in np.percentile(d, [10, 90]))
        else:
            low, high = float(d.min()), float(d.max())
        note = f"{d.size} finished run{'s' if d.size != 1 else ''} of like jobs (same user and name)"
        if time_limit_s is not None:
            point, low, high = (min(x, time_limit_s) for x in (point, low, high))
            note += f", capped by the time limit {time_limit_s / 60:.0f} min"
        return RunTime(point, low, high, "history", note)
    if time_limit_s is not None:
        note = f"time limit {time_limit_s / 60:.0f} min (an upper bound){restarts}"
        return RunTime(
            time_limit_s + extra, time_limit_s * LIMIT_LOW, time_limit_s + extra, "time_limit", note
        )
    return RunTime.unknown("no steps with a step model, no time limit, no finished like jobs")


@dataclass(frozen=True)
class LiveJob:
    """A job as the forecast sees it.

    Attributes:
        id: job id.
        gpus: whole GPUs it holds or asks for (0: CPU-only, not forecast, or a share).
        run: its run time (the whole run, not what is left).
        started_at: epoch seconds it started (running jobs), None while queued.
        attained_s: seconds it ran before (earlier attempts).
        stopping: a stop was requested: it ends within the grace period.
        gpu_type: the GPU type it must run on (None: any).
        share: its part of one GPU or MIG slices (``resources``), None for whole GPUs.
        placement: where it runs (running jobs, from its placement record); None: placed by the
            policy at the forward run's start, as if it started then.
    """

    id: int
    gpus: int
    run: RunTime
    team: str = "default"
    user: str = ""
    priority: int = 0
    submit_time: float = 0.0
    started_at: float | None = None
    attained_s: float = 0.0
    stopping: bool = False
    gpu_type: str | None = None
    share: GpuShare | None = None
    placement: Placement | None = None


@dataclass(frozen=True)
class Prediction:
    """When a job is expected to start and end (epoch seconds; None: unknown), with ranges."""

    start: float | None
    end: float | None
    start_range: tuple[float | None, float | None]
    end_range: tuple[float | None, float | None]
    basis: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON view: times as ISO 8601 (UTC), null where unknown."""
        return {
            "start": _iso(self.start),
            "end": _iso(self.end),
            "start_range": [_iso(t) for t in self.start_range],
            "end_range": [_iso(t) for t in self.end_range],
            "basis": self.basis,
            "note": self.note,
        }


def _iso(t: float | None) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") if t is not None else None


class _Recorder(Policy):
    """A policy that decides as ``inner`` does and records, per job, each attempt's start and stop.

    With ``views`` (job -> seconds of work left as the server's estimator sees it when the forward run
    starts), the policy is shown those estimates, as the server's policy would be, rather than the
    simulator's own history estimator, which knows nothing of the live cluster's past.
    """

    def __init__(self, inner: Policy, views: dict[int, float] | None = None) -> None:
        self.inner, self.views = inner, views
        self.name, self.summary = inner.name, inner.summary
        self.needs_oracle, self.preemptive, self.placer = inner.needs_oracle, inner.preemptive, inner.placer
        self.attempts: dict[int, list[list[float]]] = {}  # job -> [[start, stop or nan], ...]
        self._shown: dict[int, QueuedJob] = {}  # job -> its queue entry whose estimate was set

    def key(self, job: QueuedJob) -> Any:
        return self.inner.key(job)

    def decide(
        self,
        state: ClusterState,
        queue: JobQueue,
        running: Sequence[RunningJob],
        now: float,
        multi_node: bool = True,
        preempt: bool = True,
    ) -> Decision:
        if self.views is not None:
            # A job's estimate, set before it starts, is also what its RunningJob's expected end is
            # computed from (less what it ran before): running jobs need nothing more.
            for job in queue.ordered():
                if self._shown.get(job.id) is not job:
                    job.estimate = self.views.get(job.id, job.estimate)
                    self._shown[job.id] = job
        decision = self.inner.decide(state, queue, running, now, multi_node=multi_node, preempt=preempt)
        for jid in decision.preempt:
            self.attempts[jid][-1][1] = now
        for job, _ in decision.starts:
            self.attempts.setdefault(job.id, []).append([now, math.nan])
        return decision


def replay_starts(
    trace: list[TraceJob],
    nodes: list[NodeSpec],
    policy: Policy,
    config: SimConfig | None = None,
    views: dict[int, float] | None = None,
) -> dict[int, list[list[float]]]:
    """Replay ``trace`` through :func:`simulate`; each job's attempts as [start, stop] (stop: nan for
    the attempt that ran to its end). Jobs that never started are absent. ``views``: the run times
    the policy is shown (see :class:`_Recorder`)."""
    recorder = _Recorder(policy, views)
    simulate(trace, nodes, recorder, config)
    return recorder.attempts


def end_of(attempts: list[list[float]], duration: float, config: SimConfig) -> float:
    """When a job of ``duration`` s of work ends, given its attempts (the last one runs to the end).

    As the simulator charges them: an attempt stopped by preemption keeps its work up to its last
    periodic checkpoint, and every attempt after the first pays the restart overhead first.
    """
    remaining, overhead = duration, 0.0
    for start, stop in attempts[:-1]:
        progress = min(max(0.0, stop - start - overhead), remaining)
        remaining -= progress - progress % config.checkpoint_interval_s
        overhead = config.restart_overhead_s
    return attempts[-1][0] + overhead + remaining


def _forward(
    jobs: list[LiveJob],
    nodes: list[NodeSpec],
    make: Callable[[], Policy],
    pick: Callable[[RunTime], float | None],
    unknown_s: float,
    now: float,
    config: SimConfig,
    shown: dict[int, float] | None,
    cluster: Callable[[], ClusterState] | None = None,
    multi_node: bool = True,
) -> dict[int, tuple[float, float]]:
    """One forward run: job id -> (start, end) in seconds after ``now``, for the jobs it started."""
    trace, left, views = [], {}, {}
    kinds, shares, held = {}, {}, {}
    for i, job in enumerate(jobs):
        total = pick(job.run)
        if job.stopping:
            total = job.attained_s + (now - (job.started_at or now)) + 1.0
        whole = unknown_s if total is None else total
        done = job.attained_s + (now - job.started_at if job.started_at is not None else 0.0)
        left[i] = max(whole - done, 1.0)
        seen = shown.get(job.id) if shown is not None else None
        views[i] = max((whole if seen is None else seen) - done, 1.0)
        submit = 0.0 if job.started_at is not None else QUEUE_AT_S
        trace.append(TraceJob(i, submit, left[i], job.gpus, job.team, job.priority, job.user))
        if job.gpu_type:
            kinds[i] = job.gpu_type
        if job.share is not None:
            shares[i] = job.share
        if job.started_at is not None and job.placement is not None:
            held[i] = job.placement
    if not trace:
        return {}
    state = cluster() if cluster is not None else ClusterState(nodes)
    recorder = _Recorder(make(), views)
    recorder.attempts.update({i: [[0.0, math.nan]] for i in held})  # they start unplaced, at 0
    try:
        simulate(
            trace,
            nodes,
            recorder,
            config,
            cluster=state,
            gpu_types=kinds,
            shares=shares,
            held=held,
            multi_node=multi_node,
        )
    except CapacityError:
        return {}
    attempts = recorder.attempts
    out = {}
    for i, job in enumerate(jobs):
        if i in attempts:
            start = attempts[i][0][0]
            out[job.id] = (0.0 if start <= QUEUE_AT_S else start, end_of(attempts[i], left[i], config))
    return out


def never_starts(job: LiveJob, state: ClusterState, multi_node: bool = True) -> str | None:
    """Why ``job`` could never start on the empty cluster ``state`` (one line), None when it could:
    the server's own checks (its share check, its GPU count by type and by the executor's reach)."""
    if job.share is not None:
        return share_never_fits(state, job.share, job.gpu_type)
    if job.gpus <= 0:
        return "CPU-only: holds no GPU, not forecast"
    most = state.max_gpus(job.gpu_type, multi_node)
    if job.gpus > most:
        of = f" {job.gpu_type}" if job.gpu_type else ""
        where = "" if multi_node else " on one node (this executor runs a job on one node)"
        return f"asks for {job.gpus}{of} GPUs, more than the cluster's {most}{where}"
    return None


def forecast(
    jobs: list[LiveJob],
    nodes: list[NodeSpec],
    make: Callable[[], Policy],
    now: float,
    config: SimConfig | None = None,
    shown: dict[int, float] | None = None,
    ranges: bool = True,
    cluster: Callable[[], ClusterState] | None = None,
    multi_node: bool = True,
) -> dict[int, Prediction]:
    """Predictions for ``jobs``: running ones first (any order), then queued ones in queue order.

    ``make`` builds the policy in force (a fresh one per forward run). ``shown``: job id -> the whole
    run time the server's policy assumes for it (its history estimator's), which decides backfill
    and preemption as on the server; without it the policy sees the forecast's own run times.
    ``cluster`` builds the empty cluster each forward run starts from (the server's packing policy and
    task mix, its drained nodes; default ``ClusterState(nodes)``); ``multi_node`` whether the server's
    executor may spread one job over several nodes. GPU shares, MIG slices and typed
    jobs are placed as the server places them; running jobs with a placement hold it. CPU-only jobs
    and jobs that could never start here get no start or end, with the reason in their note.
    """
    config = config or SimConfig()
    empty = cluster() if cluster is not None else ClusterState(nodes)
    why = {j.id: never_starts(j, empty, multi_node) for j in jobs}
    sized = [j for j in jobs if why[j.id] is None]
    args = (now, config, shown, cluster, multi_node)
    runs = {"point": _forward(sized, nodes, make, lambda r: r.point, HORIZON_S, *args)}
    if ranges:
        runs["low"] = _forward(sized, nodes, make, lambda r: r.low, 1.0, *args)
        runs["high"] = _forward(sized, nodes, make, lambda r: r.high, HORIZON_S, *args)
    out: dict[int, Prediction] = {}
    for job in jobs:
        reason = why[job.id]
        if reason is not None:
            start = job.started_at
            out[job.id] = Prediction(start, None, (start, start), (None, None), job.run.basis, reason)
            continue
        got = {k: v.get(job.id) for k, v in runs.items()}
        out[job.id] = _combine(job, {"low": got["point"], "high": got["point"], **got}, now)
    return out


def _combine(job: LiveJob, got: dict[str, tuple[float, float] | None], now: float) -> Prediction:
    def at(which: str, part: int) -> float | None:
        pair = got[which]
        if pair is None or pair[part] >= HORIZON_S / 2:
            return None
        return now + pair[part]

    notes = [job.run.note] if job.run.note else []
    if job.started_at is not None:
        start: float | None = job.started_at
        start_range: tuple[float | None, float | None] = (start, start)
    else:
        start = at("point", 0)
        start_range = (at("low", 0), at("high", 0))
        if start is None:
            notes.append("waits for GPUs held by jobs of unknown run time")
    end = at("point", 1) if job.run.known else None
    end_range = (at("low", 1), at("high", 1)) if job.run.known else (None, None)
    lo, hi = start_range
    if start is not None:
        start_range = (
            min(lo, start) if lo is not None else start,
            max(hi, start) if hi is not None else None,
        )
    if end is not None:
        lo, hi = end_range
        end_range = (min(lo, end) if lo is not None else end, max(hi, end) if hi is not None else None)
    if job.stopping:
        notes.append("stopping")
    return Prediction(start, end, start_range, end_range, job.run.basis, "; ".join(notes))


def _around(point: float, span: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
    """``span`` widened to hold ``point``; an unknown low end is the point, an unknown high end stays so."""
    lo, hi = span
    return (point if lo is None else min(lo, point), None if hi is None else max(hi, point))


@dataclass
class Forecaster:
    """Predictions for a job service's queue, computed on demand and cached until the queue changes.

    ``service`` is the :class:`gpuyard.scheduler.service.JobService` (its store, nodes, config and
    fabric placer are read, never changed); nothing runs in the scheduler's loop.
    """

    service: Any
    cache_s: float = CACHE_S
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cached: tuple[Any, dict[int, Prediction]] | None = None
    _steps: dict[int, float | None] = field(default_factory=dict)  # job -> its step seconds (memo)

    def _policy(self) -> Policy:
        from gpuyard.scheduler.policies import make_policy

        cfg = self.service.config
        return make_policy(cfg.policy, weights=cfg.teams, allow_oracle=False, min_run_s=cfg.min_run_s)

    def _version(self, now: float) -> Any:
        from gpuyard.store.tables.jobs import JobRow

        with self.service.store.read() as s:
            row = s.execute(select(func.count(JobRow.id), func.max(JobRow.updated_at))).one()
        return (row[0], row[1], int(now // self.cache_s))

    def predictions(self, now: float | None = None) -> dict[int, Prediction]:
        """Job id -> prediction for every queued and running job.

        One request computes a new forecast at a time; the others meanwhile get the last one (a
        forecast over a thousand queued jobs takes seconds), never a wait on it.
        """
        now = time.time() if now is None else now
        version = self._version(now)
        cached = self._cached
        if cached is not None and cached[0] == version:
            return cached[1]
        if not self._lock.acquire(blocking=cached is None):
            assert cached is not None  # a blocking acquire always succeeds
            return cached[1]
        try:
            if self._cached is not None and self._cached[0] == version:
                return self._cached[1]
            jobs, _, shapes = self._live(now)
            result = forecast(
                jobs,
                self.service.nodes,
                self._policy,
                now,
                SimConfig(),
                cluster=self._cluster(shapes),
                multi_node=self._multi_node,
            )
            self._cached = (version, result)
            return result
        finally:
            self._lock.release()

    def whatif(self, spec: Any, gpu_counts: Sequence[int], now: float | None = None) -> list[dict[str, Any]]:
        """For each GPU count, when ``spec`` would start and end if submitted now (nothing submitted).

        Without a step model the run time is the asked shape's only: other GPU counts get an unknown
        end (scaling a run time by GPU count would be a guess).
        """
        now = time.time() if now is None else now
        jobs, history, shapes = self._live(now)
        asked, out = spec.resources.gpus, []
        kind = spec.resources.gpu_type
        share = share_of(spec.resources.model_dump())
        if share is not None:  # a share or MIG slices: one shape, what it asks for
            gpu_counts = [asked]
        empty = ClusterState(self.service.nodes)
        base = max((j.id for j in jobs), default=0) + 1
        doc = spec.model_dump()
        for gpus in gpu_counts:
            trial = {**doc, "resources": {**doc["resources"], "gpus": gpus}}
            run = self._run_time(trial, gpus, spec.user, spec.name, history, None)
            if gpus != asked and run.basis != "step_model" and run.known:
                run = RunTime.unknown(f"{run.basis} gives the run time on {asked} GPUs only")
            job = LiveJob(
                base, gpus, run, spec.team, spec.user, spec.priority, now, gpu_type=kind, share=share
            )
            both = [*jobs, job]
            mine = task_shapes([job_view(base, JobState.QUEUED, gpus, spec)], empty)
            build = self._cluster(shapes + mine)
            pred = forecast(
                both,
                self.service.nodes,
                self._policy,
                now,
                SimConfig(),
                cluster=build,
                multi_node=self._multi_node,
            )[base]
            shape = self._shape(gpus, kind) if share is None else _share_shape(share)
            out.append({"gpus": gpus, "shape": shape, **pred.to_dict()})
        return out

    def largest(self, gpu_type: str | None = None) -> int:
        """The most whole GPUs one job of ``gpu_type`` could get here (the executor's reach)."""
        return ClusterState(self.service.nodes).max_gpus(gpu_type, self._multi_node)

    @property
    def _multi_node(self) -> bool:
        """Whether the server's executor may spread one job over several nodes (as its tick places)."""
        return bool(getattr(getattr(self.service, "executor", None), "multi_node", True))

    def _cluster(self, shapes: Counter[tuple[Any, ...]]) -> Callable[[], ClusterState]:
        """What each forward run starts from: the server's cluster with nothing held, its packing
        policy (``ServiceConfig.packing``) having observed ``shapes`` (the jobs known now, as the
        server's tick observes them), its drained nodes drained."""
        nodes, packing = self.service.nodes, self.service.config.packing
        live = getattr(self.service, "state", None)
        drained = set(np.flatnonzero(live.drained).tolist()) if live is not None else set()

        def build() -> ClusterState:
            state = ClusterState(nodes, packing)
            if drained:
                state.set_drained(drained)
            state.observe(shapes)
            return state

        return build

    def _shape(self, gpus: int, gpu_type: str | None = None) -> str:
        """How ``gpus`` GPUs (of ``gpu_type``) sit on the cluster when consolidated (one node, ...)."""
        from gpuyard.scheduler.fabric_placement import shape_of
        from gpuyard.scheduler.placement import place

        state = ClusterState(self.service.nodes)
        p = place(state, gpus, gpu_type, multi_node=self._multi_node)
        if p is None:
            return "does not fit"
        return str(shape_of(state, p).describe())

    def _live(self, now: float) -> tuple[list[LiveJob], History, Counter[tuple[Any, ...]]]:
        """The queued and running jobs (running first, queued in the policy's order), the history of
        finished ones, and the jobs known now as the packing policy's task shapes."""
        from gpuyard.store.tables.jobs import JobRow

        with self.service.store.read() as s:
            finished = s.scalars(select(JobRow).where(JobRow.state == JobState.SUCCEEDED.value))
            history = History.from_rows(finished)
            holding = list(s.scalars(select(JobRow).where(JobRow.state.in_(HOLDING))))
            pending = list(s.scalars(select(JobRow).where(JobRow.state.in_(PENDING))))
        running = [
            self._live_job(r, history, r.started_at or datetime.fromtimestamp(now, UTC)) for r in holding
        ]
        queued = [self._live_job(r, history, None) for r in pending]
        policy = self._policy()
        order = {
            j.id: policy.key(
                QueuedJob(
                    id=j.id,
                    gpus=j.gpus,
                    team=j.team,
                    user=j.user,
                    priority=j.priority,
                    submit_time=j.submit_time,
                    estimate=j.run.point if j.run.point is not None else 3600.0,
                    gpu_type=j.gpu_type,
                    attained=j.attained_s,
                    share=j.share,
                )
            )
            for j in queued
        }
        queued.sort(key=lambda j: order[j.id])
        views = []
        for r in [*holding, *pending]:
            try:
                spec = JobSpec.model_validate(r.spec)
            except ValidationError:  # a spec of an older version: no shape for the packing mix
                continue
            views.append(job_view(r.id, JobState(r.state), r.gpus, spec))
        shapes = task_shapes(views, ClusterState(self.service.nodes))
        jobs = [*sorted(running, key=lambda j: (j.started_at or 0.0, j.id)), *queued]
        return jobs, history, shapes

    def _live_job(self, row: Any, history: History, started: datetime | None) -> LiveJob:
        spec = row.spec or {}
        resources = spec.get("resources") or {}
        run = self._run_time(spec, row.gpus, row.user, row.name, history, row.id)
        return LiveJob(
            id=row.id,
            gpus=row.gpus,
            run=run,
            team=row.team,
            user=row.user,
            priority=row.priority,
            submit_time=row.submitted_at.timestamp(),
            started_at=started.timestamp() if started is not None else None,
            attained_s=float(row.attained_s or 0.0),
            stopping=bool(row.stop_requested),
            gpu_type=resources.get("gpu_type") or None,
            share=share_of(resources),
            placement=held_placement(row.placement, self.service.nodes) if started is not None else None,
        )

    def _run_time(
        self, spec: dict[str, Any], gpus: int, user: str, name: str, history: History, job_id: int | None
    ) -> RunTime:
        limit = spec.get("time_limit_min")
        workload = spec.get("workload") or {}
        steps = workload.get("steps") if isinstance(workload, dict) else None
        step_s = None
        if steps:
            if job_id is None or job_id not in self._steps:
                step_s = self._step_seconds(workload, gpus, (spec.get("resources") or {}).get("gpu_type"))
                if job_id is not None:
                    self._steps[job_id] = step_s
            else:
                step_s = self._steps[job_id]
        return estimate_run_time(
            float(limit) * 60 if limit else None,
            history.like(user, name),
            int(steps) if steps else None,
            step_s,
            SimConfig(),
        )

    def _step_seconds(self, workload: dict[str, Any], gpus: int, gpu_type: str | None) -> float | None:
        """The fabric step model's step time of ``workload`` on its consolidated placement (None: no
        fabric cluster on this server, or the model cannot cost it)."""
        placer = getattr(self.service, "placer", None)
        if placer is None or gpus <= 0:
            return None
        from gpuyard.scheduler.fabric_placement import shape_of, workload_of
        from gpuyard.scheduler.spec import WorkloadSpec

        try:
            wl = workload_of(WorkloadSpec.model_validate(workload))
        except Exception:  # checked at submit; a spec of an older version is simply not costed
            return None
        state = ClusterState(self.service.nodes)
        ideal = placer.ideal(state, gpus, gpu_type)
        return placer.step(wl, shape_of(state, ideal)) if ideal is not None else None


def held_placement(record: Any, nodes: Sequence[NodeSpec]) -> Placement | None:
    """Where a running job runs, from its placement record (``JobRow.placement``, read as the
    server's :class:`gpuyard.scheduler.core.PlacedPart` reads it): whole GPUs, CPU slots, shares and
    MIG slices on ``nodes``. None when there is none, when it is not a placement record, or when it
    names a node this cluster does not have or a GPU that node does not have (then the forward run
    places the job anew)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    try:
        parts = [PlacedPart.of_record(p) for p in (record or {}).get("nodes", [])]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not parts or any(p.node not in index for p in parts):
        return None
    held: list[tuple[int, int]] = []
    shares: list[SharePart] = []
    cpus = 0
    for p in parts:
        i = index[p.node]
        gpus = [g for g, _, _ in p.mig] if p.mig else list(p.gpus)
        if any(not 0 <= g < nodes[i].gpus for g in gpus):
            return None
        if p.mig:
            shares += [SharePart(i, gpu, 0.0, 0.0, uuid, profile) for gpu, profile, uuid in p.mig]
        elif p.share is not None:
            shares += [SharePart(i, g, p.share[0], p.share[1]) for g in p.gpus]
        else:
            held.append((i, len(p.gpus)))
            cpus = max(cpus, p.cpus) if not p.gpus else cpus
    return Placement(tuple(held), "running", cpus=cpus, parts=tuple(shares))


def _share_shape(share: GpuShare) -> str:
    """How a share sits: MIG slices of one GPU, or part of one GPU."""
    if share.mig:
        return f"{share.slices} MIG {share.mig} slice(s) on one node"
    parts = [
        f"{share.fraction:g} of a GPU" if share.fraction is not None else "",
        f"{share.memory_gb:g} GB of its memory" if share.memory_gb is not None else "",
    ]
    return "share: " + ", ".join(p for p in parts if p)


def job_view(job_id: int, state: JobState, gpus: int, spec: JobSpec) -> JobView:
    """A job as the scheduling core sees it, as far as its task shape goes (what
    :func:`gpuyard.scheduler.core.task_shapes` reads): its state, GPUs, spec and share."""
    share = share_of(spec.resources.model_dump())
    return JobView(
        job_id,
        state,
        spec.name,
        spec.team,
        spec.user,
        spec.priority,
        gpus,
        spec,
        (gpus,),
        0.0,
        0.0,
        share=share,
    )


def whatif_counts(asked: int, largest: int, most: int | None = None) -> list[int]:
    """The GPU counts `jobs whatif` compares: as asked, half and twice that (an elastic job: its
    minimum and maximum), within 1..``largest``."""
    counts = [asked, most] if most else [asked // 2, asked, asked * 2]
    return sorted({c for c in counts if c and 1 <= c <= largest})


def add_predictions(forecaster: Forecaster, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give each job document its ``prediction`` (null for finished jobs); returns ``docs``.

    A forecast that fails leaves every prediction null and is logged: a listing never fails for it.
    """
    if any(d.get("state") in (*PENDING, *HOLDING) for d in docs):
        try:
            found = forecaster.predictions()
        except Exception:
            log.exception("predicting starts and ends failed; jobs are listed without predictions")
            found = {}
    else:
        found = {}
    for d in docs:
        p = found.get(int(d["id"])) if d.get("state") in (*PENDING, *HOLDING) else None
        d["prediction"] = p.to_dict() if p is not None else None
    return docs
