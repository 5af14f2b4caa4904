"""Experiments with the packing policies on the share model: the FGD paper's fill (tasks arrive until
the cluster is full, measuring unallocated GPU capacity) and a replay of a trace with durations (JCT).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.scheduler.fragmentation import Fragmentation, TaskMix
from gpuyard.scheduler.gpushares import Placement, SharedCluster
from gpuyard.scheduler.openb import MILLI, GpuTask
from gpuyard.scheduler.packing import PackingPolicy


def inflate(tasks: Sequence[GpuTask], capacity_gpus: float, ratio: float, seed: int) -> list[GpuTask]:
    """The paper's arrivals: the trace's tasks, topped up by random copies (or thinned at random)
    until their GPU requests come to ``ratio`` x the cluster's GPUs, in a random order.
    """
    rng = np.random.default_rng(seed)
    target = ratio * capacity_gpus
    out = list(tasks)
    asked = sum(t.gpu for t in out)
    if not any(t.gpu for t in tasks):
        raise ConfigError("no task asks for a GPU: nothing fills the cluster")
    while asked > target:
        asked -= out.pop(int(rng.integers(len(out)))).gpu
    while True:
        t = tasks[int(rng.integers(len(tasks)))]
        if asked + t.gpu > target:
            break
        out.append(t)
        asked += t.gpu
    return [out[i] for i in rng.permutation(len(out))]


@dataclass
class FillResult:
    """Unallocated GPU capacity (fraction) as arrived GPU requests reach each of ``points`` (fractions
    of the cluster's GPUs), the expected fragmentation rate there, and the tasks placed and refused.

    With GPUs in MIG mode, also the unallocated share of their compute slices at each point, and the
    MIG tasks placed and refused (absent from :meth:`to_dict` otherwise).
    """

    policy: str
    capacity_gpus: float
    points: list[float]
    unallocated: list[float]
    fragmentation: list[float]
    placed: int = 0
    failed: int = 0
    failed_gpu: float = 0.0
    mig_unallocated: list[float] = field(default_factory=list)
    mig_placed: int = 0
    mig_failed: int = 0

    def at(self, point: float) -> float:
        """Unallocated fraction when arrivals reached ``point`` (the nearest recorded point)."""
        i = int(np.argmin(np.abs(np.array(self.points) - point)))
        return self.unallocated[i]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        doc = dict(self.__dict__)
        if not self.mig_unallocated:
            for key in ("mig_unallocated", "mig_placed", "mig_failed"):
                del doc[key]
        return doc


def fill(
    cluster: SharedCluster,
    arrivals: Sequence[GpuTask],
    policy: PackingPolicy,
    points: Sequence[float] | None = None,
    mix: TaskMix | None = None,
) -> FillResult:
    """Place ``arrivals`` one after the other (none leaves; one that fits nowhere is dropped).

    Records, as the arrived GPU requests pass each of ``points`` (default 0 to 1.3 by 0.05, as
    fractions of the cluster's GPUs), the unallocated fraction of GPU capacity and, with ``mix``,
    the expected fragmentation rate.
    """
    pts = sorted(points) if points is not None else [round(0.05 * i, 2) for i in range(27)]
    capacity = cluster.capacity_milli / MILLI
    frag = Fragmentation(mix, cluster) if mix is not None else None
    result = FillResult(policy.name, capacity, [], [], [])

    def record(point: float) -> None:
        result.points.append(point)
        result.unallocated.append(cluster.unallocated)
        rate = float(frag.of_nodes(cluster).sum()) / cluster.capacity_milli if frag is not None else math.nan
        result.fragmentation.append(rate)
        if cluster.has_mig:
            result.mig_unallocated.append(cluster.mig_unallocated)

    arrived, k = 0.0, 0
    for task in arrivals:
        while k < len(pts) and arrived + task.gpu > pts[k] * capacity + 1e-9:
            record(pts[k])
            k += 1
        arrived += task.gpu
        choice = policy.choose(cluster, task)
        if choice is None:
            result.failed += 1
            result.failed_gpu += task.gpu
            result.mig_failed += bool(task.mig)
            continue
        cluster.place(task, choice)
        result.placed += 1
        result.mig_placed += bool(task.mig)
    while k < len(pts):
        record(pts[k])
        k += 1
    return result


@dataclass
class ReplayResult:
    """JCT and queueing of a replay with durations (seconds), under one packing policy."""

    policy: str
    tasks: int
    rejected: int  # fit no node of the empty cluster
    avg_jct_s: float
    median_jct_s: float
    p99_jct_s: float
    avg_wait_s: float
    waited: int  # tasks that could not start at once
    avg_unallocated: float  # time-average unallocated fraction of GPU capacity while some task waits
    makespan_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dict(self.__dict__)


def time_scale_for(tasks: Sequence[GpuTask], capacity_gpus: float, load: float) -> float:
    """The factor on creation times that makes the offered load (GPU-seconds asked per second of the
    arrival span, over the cluster's GPUs) ``load``.

    Raises:
        ConfigError: no times, or nothing asked.
    """
    times = [t.creation for t in tasks if t.creation is not None]
    work = sum(t.gpu * (t.duration or 0.0) for t in tasks)
    if len(times) < 2 or max(times) == min(times) or work <= 0 or load <= 0:
        raise ConfigError("an offered load needs tasks with creation times, durations and GPUs")
    return work / ((max(times) - min(times)) * capacity_gpus * load)


def replay(
    cluster: SharedCluster, tasks: Sequence[GpuTask], policy: PackingPolicy, time_scale: float = 1.0
) -> ReplayResult:
    """Replay ``tasks`` (with creation and duration) on ``cluster``: arrivals at ``creation`` x
    ``time_scale``, each runs ``duration`` s once started; waiting tasks start in arrival order
    whenever one fits (a task that fits nowhere now does not hold back later ones).

    With MIG tasks, ``extra`` has their number (``mig_tasks``, ``mig_rejected``), average JCT and
    wait, and the time-average unallocated share of the MIG GPUs' compute while some task waited
    (``mig_avg_unallocated``).

    Raises:
        ConfigError: a task has no creation time or duration.
        CapacityError: no task fits on the empty cluster.
    """
    if any(t.creation is None or t.duration is None for t in tasks):
        raise ConfigError("replaying for JCT needs creation and deletion times (this pod list has none)")
    runnable = [t for t in tasks if cluster.fits_empty(t)]
    if not runnable:
        raise CapacityError("no task of the trace fits on any node")
    order = sorted(range(len(runnable)), key=lambda i: (runnable[i].creation or 0.0, i))
    t0 = min(t.creation or 0.0 for t in runnable)
    arrive = {i: ((runnable[i].creation or 0.0) - t0) * time_scale for i in order}
    start: dict[int, float] = {}
    ends: list[tuple[float, int]] = []
    running: dict[int, Placement] = {}
    waiting: list[int] = []
    nxt, now = 0, 0.0
    wait_area, wait_time, last, mig_area = 0.0, 0.0, 0.0, 0.0
    while nxt < len(order) or ends or waiting:
        t_arr = arrive[order[nxt]] if nxt < len(order) else math.inf
        t_end = ends[0][0] if ends else math.inf
        if math.isinf(t_arr) and math.isinf(t_end):
            break  # tasks still waiting but nothing will change: cannot happen when all fit empty
        now = min(t_arr, t_end)
        if waiting:
            wait_area += (now - last) * cluster.unallocated
            wait_time += now - last
            if cluster.has_mig:
                mig_area += (now - last) * cluster.mig_unallocated
        last = now
        freed = bool(ends) and ends[0][0] <= now
        while ends and ends[0][0] <= now:
            _, i = heapq.heappop(ends)
            cluster.release(runnable[i], running.pop(i))
        arrived = []
        while nxt < len(order) and arrive[order[nxt]] <= now:
            arrived.append(order[nxt])
            nxt += 1
        # Without a completion nothing was freed: who waited still cannot start; try the newcomers.
        still, refused = ([], set()) if freed else (waiting, {runnable[i].shape for i in waiting})
        for i in waiting + arrived if freed else arrived:
            task = runnable[i]
            choice = None if task.shape in refused else policy.choose(cluster, task)
            if choice is None:
                refused.add(task.shape)
                still.append(i)
                continue
            cluster.place(task, choice)
            running[i] = choice
            start[i] = now
            heapq.heappush(ends, (now + (task.duration or 0.0), i))
        waiting = still
    jct = np.array([start[i] + (runnable[i].duration or 0.0) - arrive[i] for i in order])
    wait = np.array([start[i] - arrive[i] for i in order])
    finish = max(start[i] + (runnable[i].duration or 0.0) for i in order)
    extra: dict[str, float] = {}
    mig = np.array([bool(runnable[i].mig) for i in order], dtype=np.bool_)
    if mig.any() or any(t.mig for t in tasks):
        extra = {
            "mig_tasks": int(mig.sum()),
            "mig_rejected": sum(bool(t.mig) for t in tasks) - int(mig.sum()),
            "mig_avg_jct_s": float(jct[mig].mean()) if mig.any() else math.nan,
            "mig_avg_wait_s": float(wait[mig].mean()) if mig.any() else math.nan,
            "mig_avg_unallocated": mig_area / wait_time if wait_time > 0 and cluster.has_mig else math.nan,
        }
    return ReplayResult(
        policy=policy.name,
        tasks=len(runnable),
        rejected=len(tasks) - len(runnable),
        avg_jct_s=float(jct.mean()),
        median_jct_s=float(np.median(jct)),
        p99_jct_s=float(np.percentile(jct, 99)),
        avg_wait_s=float(wait.mean()),
        waited=int((wait > 0).sum()),
        avg_unallocated=wait_area / wait_time if wait_time > 0 else math.nan,
        makespan_s=finish,
        extra=extra,
    )
