"""Benchmark: how close gpuyard's predicted start of a job comes to the start it really gets.

Each trace is replayed once through the simulator (:func:`gpuyard.scheduler.simulator.simulate`, FIFO
with EASY backfill, the policy a backfill estimate describes); that replay's start of every job is the
truth. At sampled submissions the state the server would know then is rebuilt (jobs submitted so far
with their GPU counts and time limits, which of them run and since when, the run times of those that
have finished; never the run time of a job still running or queued) and the queue is run forward
(:func:`gpuyard.scheduler.eta.forecast`) twice:

- gpuyard: each job's run time from finished like jobs (``estimate_run_time``: the median of their run
  times, capped by its time limit; with none finished, its time limit), the policy in the forward run
  shown those same run times (showing it the replay's own history estimates instead changed nothing
  where history exists and starved jobs where it does not: 2026-11-29, a Philly slice and --smoke);
- baseline: a backfill estimate from requested time limits (every job runs to its limit, the policy
  sees limits): what Slurm's ``squeue --start`` computes.

The traces name no user and no job, so "like jobs" are those of the same team (Philly virtual cluster;
openb: one team) and GPU count. Neither trace records time limits; they are drawn per job from a model
of users' estimates after Tsafrir, Etsion & Feitelson, "Modeling User Runtime Estimates" (JSSPP 2005,
LNCS 3834) and Tsafrir, "Using Inaccurate Estimates Accurately" (JSSPP 2010): estimates are modal,
about 20 round values covering 90% of jobs, and the system's maximum is always a popular one.
Here: ``MAX_SHARE`` of jobs ask for the maximum (the largest round value above every run time); the
rest ask for the smallest round value at least their run time times a factor uniform in
[1, ``MAX_FACTOR``] (the factor's spread is this script's assumption, not the papers' figure).

Traces: Philly (82,247 jobs; 64 nodes x 8 GPUs) and Alibaba's openb gpushare40 pod list with its
creation and deletion times (GPU tasks only, a share counted as a whole GPU; arrivals ``OPENB_SPEEDUP``
times faster on 32 x 8 GPUs, since at real speed its 14 GPUs of average demand never queue), from
``../shared/traces`` or ``$GPUYARD_TRACES``. ``--smoke`` uses their first jobs, or generated traces
when they are missing (seconds, no figure).

Last line: ``eta_accuracy: median_abs_err_min=<x> p90_abs_err_min=<y> vs_time_limit=<baseline median
error / gpuyard's>`` over both traces' samples together, then the same keys per trace.

    python benchmarks/eta_accuracy.py [--samples 400] [--smoke]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from gpuyard.scheduler.eta import LikeRuns, LiveJob, RunTime, estimate_run_time, forecast, replay_starts
from gpuyard.scheduler.openb import load_openb_tasks, traces_dir
from gpuyard.scheduler.placement import NodeSpec, uniform_cluster
from gpuyard.scheduler.policies import make_policy
from gpuyard.scheduler.trace import TraceJob, load_trace

POLICY = "fifo-backfill"
# Round limits users pick (minutes): the modal values of Tsafrir et al.'s logs are of this kind.
ROUND_MIN = (5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 360, 480, 600, 720, 960, 1080, 1440, 2880, 4320)
MAX_SHARE = 0.10  # jobs asking for the maximum allowed
MAX_FACTOR = 4.0  # the rest: their run time times U(1, MAX_FACTOR), rounded up to a round value
OPENB_SPEEDUP = 16.0
OPENB_NODES = 32
SEED = 7


def time_limits(trace: Sequence[TraceJob], seed: int = SEED) -> dict[int, float]:
    """A time limit in seconds for every job (see the module docstring), reproducible per seed."""
    rng = random.Random(seed)
    rounds = [m * 60.0 for m in ROUND_MIN]
    longest = max(j.duration for j in trace)
    top = next((r for r in rounds if r >= longest), math.ceil(longest / 86400.0) * 86400.0)
    out = {}
    for j in trace:
        if rng.random() < MAX_SHARE:
            out[j.id] = top
            continue
        want = max(j.duration, 1.0) * rng.uniform(1.0, MAX_FACTOR)
        out[j.id] = next((r for r in rounds if r >= want), top)
    return out


@dataclass
class Errors:
    """Absolute errors of predicted starts, minutes, per predictor, and which samples were contended
    (the job waited, or a predictor said it would): where a prediction says more than "now"."""

    gpuyard: list[float]
    baseline: list[float]
    contended: list[bool]
    waited: int = 0

    def only(self, keep: list[bool]) -> Errors:
        """The samples where ``keep`` is true."""
        pick = [i for i, k in enumerate(keep) if k]
        return Errors([self.gpuyard[i] for i in pick], [self.baseline[i] for i in pick], [True] * len(pick))


def evaluate(trace: list[TraceJob], nodes: list[NodeSpec], samples: int, label: str) -> Errors:
    """Replay ``trace``, then predict the start of ``samples`` submissions spread over it."""
    t0 = time.perf_counter()
    limits = time_limits(trace)
    attempts = replay_starts(trace, nodes, make_policy(POLICY))
    start = {jid: a[0][0] for jid, a in attempts.items()}
    jobs = [j for j in trace if j.id in start]
    end = {j.id: start[j.id] + j.duration for j in jobs}
    print(f"{label}: {len(jobs)} jobs replayed in {time.perf_counter() - t0:.1f} s")
    by_submit = sorted(jobs, key=lambda j: (j.submit, j.id))
    by_end = sorted(jobs, key=lambda j: (end[j.id], j.id))
    picks = sorted({int(i) for i in np.linspace(0, len(by_submit) - 1, samples)})
    make = partial(make_policy, POLICY)
    errs = Errors([], [], [])
    like, done = dict[tuple[str, int], list[float]](), 0
    t1 = time.perf_counter()
    for k in picks:
        job = by_submit[k]
        now = job.submit
        while done < len(by_end) and end[by_end[done].id] <= now:
            f = by_end[done]
            like.setdefault((f.team, f.gpus), []).append(f.duration)
            done += 1
        known = [j for j in by_submit[: k + 1] if end[j.id] > now or start[j.id] >= now]
        running = [j for j in known if start[j.id] < now]
        queued = [j for j in known if start[j.id] >= now]  # in submission order: FIFO's
        ours, base = [], []
        runs: dict[tuple[str, int], RunTime] = {}
        for j in [*running, *queued]:
            began = start[j.id] if start[j.id] < now else None
            cls = (j.team, j.gpus)
            if cls not in runs:
                past = like.get(cls)
                runs[cls] = estimate_run_time(None, LikeRuns(tuple(past)) if past else None)
            limit = limits[j.id]
            run = runs[cls]
            if run.point is None:
                run = estimate_run_time(limit, None)
            else:
                run = RunTime(*(min(x, limit) for x in (run.point, run.low, run.high)), run.basis)  # type: ignore[type-var]
            ours.append(LiveJob(j.id, j.gpus, run, j.team, j.user, j.priority, j.submit, began))
            base.append(
                LiveJob(j.id, j.gpus, RunTime(limit, limit, limit, "time_limit"), j.team, started_at=began)
            )
        p_ours = forecast(ours, nodes, make, now, ranges=False)[job.id].start
        p_base = forecast(base, nodes, make, now, ranges=False)[job.id].start
        truth = start[job.id]
        errs.waited += truth > now
        errs.contended.append(truth > now or p_ours != now or p_base != now)
        if len(errs.gpuyard) % 50 == 49:
            print(
                f"{label}: {len(errs.gpuyard) + 1} predictions, {time.perf_counter() - t1:.0f} s", flush=True
            )
        errs.gpuyard.append(abs((p_ours if p_ours is not None else math.inf) - truth) / 60.0)
        errs.baseline.append(abs((p_base if p_base is not None else math.inf) - truth) / 60.0)
    print(
        f"{label}: {len(picks)} predictions in {time.perf_counter() - t1:.1f} s; "
        f"{errs.waited} of those jobs waited"
    )
    return errs


def summary(errs: Errors) -> tuple[float, float, float, float]:
    """(median, p90) of gpuyard's errors, the baseline's median, and baseline / gpuyard."""
    ours, base = np.asarray(errs.gpuyard), np.asarray(errs.baseline)
    if not ours.size:
        return math.nan, math.nan, math.nan, math.nan
    med, p90, bmed = float(np.median(ours)), float(np.percentile(ours, 90)), float(np.median(base))
    return med, p90, bmed, bmed / med if med > 0 else (math.inf if bmed > 0 else 1.0)


def philly(smoke: bool) -> list[TraceJob]:
    path = traces_dir() / "philly.csv"
    if not path.is_file():
        if not smoke:
            raise SystemExit(f"no Philly trace at {path} (set GPUYARD_TRACES)")
        return generated(600, seed=1)
    trace = load_trace(path)
    return trace[:1500] if smoke else trace


def openb(smoke: bool) -> list[TraceJob]:
    path = traces_dir() / "openb_pod_list_gpushare40.csv"
    if not path.is_file():
        if not smoke:
            raise SystemExit(f"no openb pod list at {path} (set GPUYARD_TRACES)")
        return generated(600, seed=2)
    tasks = [t for t in load_openb_tasks(path) if t.num_gpu >= 1 and t.creation is not None]
    tasks.sort(key=lambda t: (t.creation, t.name))
    t0 = tasks[0].creation or 0.0
    trace = [
        TraceJob(i, ((t.creation or 0.0) - t0) / OPENB_SPEEDUP, float(t.duration or 0.0), t.num_gpu, "openb")
        for i, t in enumerate(tasks)
    ]
    return trace[:1500] if smoke else trace


def generated(n: int, seed: int) -> list[TraceJob]:
    """A bursty trace with heavy-tailed run times (when the shared traces are not here)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1 / 120.0)
        out.append(TraceJob(i, t, rng.lognormvariate(7.0, 1.5), rng.choice((1, 1, 1, 2, 4, 8)), f"t{i % 3}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=300, help="predictions per trace")
    ap.add_argument("--nodes", type=int, default=80, help="Philly's cluster: nodes of 8 GPUs")
    ap.add_argument("--smoke", action="store_true", help="CI: the traces' first jobs, 25 predictions each")
    args = ap.parse_args()
    samples = 25 if args.smoke else args.samples
    results = {
        "philly": evaluate(
            philly(args.smoke), uniform_cluster(8 if args.smoke else args.nodes, 8), samples, "philly"
        ),
        "openb": evaluate(
            openb(args.smoke), uniform_cluster(4 if args.smoke else OPENB_NODES, 8), samples, "openb"
        ),
    }
    print(
        f"{'trace':>8} {'samples':>7} {'contended':>9} {'median min':>10} {'p90 min':>8} {'limit median':>12}"
        f" {'limit/ours':>10} {'all: median':>11} {'limit median':>12}"
    )
    keys = []
    for name, errs in results.items():
        hard = errs.only(errs.contended)
        med, p90, bmed, ratio = summary(hard)
        amed, _, abmed, _ = summary(errs)
        print(
            f"{name:>8} {len(errs.gpuyard):7d} {len(hard.gpuyard):9d} {med:10.1f} {p90:8.1f} {bmed:12.1f}"
            f" {ratio:10.2f} {amed:11.1f} {abmed:12.1f}"
        )
        keys.append(f"{name}_median_abs_err_min={med:.1f} {name}_p90_abs_err_min={p90:.1f}")
        keys.append(f"{name}_vs_time_limit={ratio:.2f} {name}_contended={len(hard.gpuyard)}")
    hard = Errors([], [], [])
    for errs in results.values():
        part = errs.only(errs.contended)
        hard.gpuyard += part.gpuyard
        hard.baseline += part.baseline
    med, p90, bmed, ratio = summary(hard)
    print(
        f"eta_accuracy: median_abs_err_min={med:.1f} p90_abs_err_min={p90:.1f} vs_time_limit={ratio:.2f} "
        f"time_limit_median_abs_err_min={bmed:.1f} {' '.join(keys)} contended={len(hard.gpuyard)}"
    )


if __name__ == "__main__":
    main()
