"""Goodput of a training run: ETTR (productive training time / wall time) and the time lost, by cause.

Read from the run folder's ``metrics.jsonl`` (every attempt appends to it), which holds:

* ``launch`` / ``launch_end``: written by ``gpuyard train`` (the launcher) when it starts torchrun
  and when torchrun has exited; one pair per launch (a job requeued by the scheduler launches again);
* ``attempt``: written by rank 0 once the trainer is set up: ``started`` (when its process built the
  trainer), ``step`` (the step it resumed from; 0 for a fresh start), ``restart`` (torchrun's count);
* ``metrics`` per step: its end (``time``), ``step_time`` (data, compute and the per-step
  all-reduce), ``data_wait_s`` and ``straggler_wait_s`` (below), ``steps_time_s`` when
  ``log_every_steps`` > 1 (the step times summed since the previous line);
* ``checkpoint`` (``seconds``), ``memory_snapshot`` (``stall_s``) and ``memory_snapshot_wait``
  (``seconds``, inside the next step), ``finish``.

The wall time of a run is the sum over its launches of launch to launch end (to the last event when a
launch left no end, e.g. the launcher was killed). Each second of it belongs to exactly one of:

``productive``  the steps the final model descends from, less their data, straggler and snapshot waits;
``startup``     the first launch, from ``launch`` to the start of its first step (process start,
                imports, process group, model build, loading a checkpoint);
``restart``     from the last sign of life of an attempt that did not finish (its last event) to the
                first step of the attempt after it, and a later launch from ``launch`` to its first
                step (failure detection, the part of the step the failure cut short, teardown, new
                processes, restore);
``recomputed``  steps done, then lost by a failure: those past the step the next attempt resumed
                from (the last checkpoint), their whole step time;
``checkpoint``  storage checkpoints (``seconds``), in-memory snapshot stalls (``stall_s``) and the
                waits of the next step for a snapshot's copy, of the kept steps and between steps;
``data``        of each kept step, the median over ranks of the time waiting for batches
                (rank 0's own without straggler detection or on one rank);
``straggler``   of each kept step, how much longer the slowest rank's own time (data + compute) was
                than the other ranks' median, when it is slower by the straggler rule (slowdown and
                min_seconds of ``spec.straggler``): the time every other rank waited for it; and
                a stall: of a step (not an attempt's first) whose time less these waits is over
                ``STALL_FACTOR`` x the run's median step and ``STALL_MIN_S`` more, that excess
                (a rank stopped inside a collective keeps every rank waiting there alike);
``other``       the rest: validation, logging and callbacks between steps, the end of a launch after
                its last step (shutdown), steps not logged at all.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuyard.states import TrainOutcome

# A kept step whose time (less its waits) is over STALL_FACTOR x the run's median and at least
# STALL_MIN_S more counts its excess as straggler wait (a stall inside a collective).
STALL_FACTOR = 3.0
STALL_MIN_S = 0.1
CAUSES = ("queueing", "startup", "restart", "recomputed", "checkpoint", "data", "straggler", "other")


@dataclass
class Goodput:
    """Productive seconds and lost seconds by cause over a wall time; :meth:`as_dict` is the API's object."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))

    @property
    def ettr(self) -> float | None:
        """Productive / wall (None before any wall time)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def lose(self, cause: str, seconds: float) -> None:
        """Add ``seconds`` (negative amounts are ignored) to ``cause``."""
        if seconds > 0:
            self.lost_s[cause] = self.lost_s.get(cause, 0.0) + seconds

    def as_dict(self) -> dict[str, Any]:
        """``{"ettr", "wall_s", "productive_s", "lost_s": {cause: seconds}}``, rounded to milliseconds."""
        ettr = self.ettr
        return {
            "ettr": None if ettr is None else round(ettr, 4),
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "lost_s": {c: round(self.lost_s.get(c, 0.0), 3) for c in CAUSES},
        }


def step_waits(
    data: list[float], own: list[float], slowdown: float, min_seconds: float
) -> tuple[float, float]:
    """(data wait, straggler wait) of one step from every rank's data time and own time (data + compute).

    Data wait: the median rank's wait for batches. Straggler wait: the slowest rank's own time less
    the other ranks' median, when that rank is slower by the straggler rule; else 0.
    """
    if not data:
        return 0.0, 0.0
    wait = float(statistics.median(data))
    if len(own) < 2:
        return wait, 0.0
    slowest = max(range(len(own)), key=own.__getitem__)
    ref = float(statistics.median(own[:slowest] + own[slowest + 1 :]))
    extra = own[slowest] - ref
    if own[slowest] > slowdown * ref and extra >= min_seconds:
        return wait, extra
    return wait, 0.0


@dataclass
class _Step:
    seconds: float
    data: float
    straggler: float
    snapshot: float
    steps: int = 1  # how many steps the line covers (log_every_steps > 1)
    first: bool = False  # the first step of an attempt (warm-up: never taken for a stall)

    @property
    def rest(self) -> float:
        """The step time less its data, straggler and snapshot waits."""
        return max(0.0, self.seconds - self.data - self.snapshot - min(self.straggler, self.seconds))


@dataclass
class _Attempt:
    started: float | None = None
    resumed: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Launch:
    start: float | None = None
    end: float | None = None
    attempts: list[_Attempt] = field(default_factory=list)


def _launches(events: Iterable[dict[str, Any]]) -> list[_Launch]:
    launches: list[_Launch] = []
    for ev in events:
        name = ev.get("event")
        if name == "launch" or not launches:
            launches.append(_Launch(start=ev.get("time") if name == "launch" else None))
            if name == "launch":
                continue
        launch = launches[-1]
        if name == "launch_end":
            launch.end = ev.get("time")
            continue
        if name == "attempt" and launch.attempts and _unstarted(launch.attempts[-1]):
            # The trainer writes `params` just before `attempt`: the same attempt.
            launch.attempts[-1].started, launch.attempts[-1].resumed = (
                ev.get("started"),
                int(ev.get("step", 0)),
            )
        elif name == "attempt" or not launch.attempts:
            launch.attempts.append(
                _Attempt(
                    started=ev.get("started") if name == "attempt" else None,
                    resumed=int(ev.get("step", 0)) if name == "attempt" else 0,
                )
            )
        launch.attempts[-1].events.append(ev)
    return launches


def _unstarted(attempt: _Attempt) -> bool:
    return attempt.started is None and not any(e.get("event") == "metrics" for e in attempt.events)


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def compute(events: Iterable[dict[str, Any]], now: float | None = None) -> Goodput:
    """The goodput of a run from its ``metrics.jsonl`` events, in file order (see the module).

    ``now``: the end of a launch still running (default: its last event).
    """
    gp = Goodput()
    kept: dict[int, _Step] = {}  # step -> the execution of it the model descends from (so far)
    launches = _launches(events)
    for n, launch in enumerate(launches):
        times = [_float(e.get("time")) for a in launch.attempts for e in a.events if "time" in e]
        start = launch.start if launch.start is not None else (min(times) if times else None)
        if start is None:
            continue
        running = now if n == len(launches) - 1 else None  # only the last launch may still run
        end = launch.end if launch.end is not None else max([*times, start, running or 0.0])
        gp.wall_s += max(0.0, end - start)
        cursor = start  # everything before it is accounted for
        before_step = "startup" if n == 0 else "restart"  # the cause of the time up to the next step
        finished = False
        live = running is not None and launch.end is None  # still running: its tail is no failure
        for k, attempt in enumerate(launch.attempts):
            if attempt.started is not None:  # it resumed from attempt.resumed: later steps are lost
                for step in [s for s in kept if s > attempt.resumed]:
                    gp.lose("recomputed", kept.pop(step).seconds)
            ckpt = wait = 0.0  # checkpoint seconds since the last step; snapshot waits in the next
            prev = attempt.resumed if attempt.started is not None else None
            for ev in attempt.events:
                name = ev.get("event")
                if name in ("checkpoint", "memory_snapshot"):
                    ckpt += _float(ev.get("seconds", ev.get("stall_s")))
                elif name == "memory_snapshot_wait":
                    wait += _float(ev.get("seconds"))
                elif name == "metrics" and "step" in ev and "step_time" in ev:
                    seconds = _float(ev.get("steps_time_s", ev.get("step_time")))
                    t_end = _float(ev.get("time"))
                    gap = max(0.0, t_end - seconds - cursor)
                    gp.lose("checkpoint", min(gap, ckpt))
                    gp.lose(before_step, gap - min(gap, ckpt))
                    step = int(ev["step"])
                    if step in kept:  # done before without an attempt event saying so: recomputed
                        gp.lose("recomputed", kept.pop(step).seconds)
                    kept[step] = _Step(
                        seconds,
                        min(seconds, _float(ev.get("data_wait_s"))),
                        _float(ev.get("straggler_wait_s")),
                        min(seconds, wait),
                        steps=max(1, step - prev) if prev is not None else 1,
                        first=prev == attempt.resumed,
                    )
                    prev = step
                    ckpt = wait = 0.0
                    cursor, before_step = max(cursor, t_end), "other"
            # After its last step: checkpoints, then shutdown (it finished) or the failure (it did not).
            last = max([_float(e.get("time")) for e in attempt.events if "time" in e] + [cursor])
            # An attempt that raised (a peer died) writes finish/failed: a failure like a kill.
            finished = any(
                e.get("event") == "finish" and e.get("status") != TrainOutcome.FAILED for e in attempt.events
            )
            gap = last - cursor
            gp.lose("checkpoint", min(gap, ckpt))
            if live and k == len(launch.attempts) - 1:  # running: starting up, or between steps
                gp.lose(before_step, gap - min(gap, ckpt))
            else:
                gp.lose("other" if finished else "restart", gap - min(gap, ckpt))
                before_step = "other" if finished else "restart"
            cursor = last
        gp.lose(before_step, end - cursor)  # shutdown, a failure's end, or (running) so far
    per_step = [st.rest / st.steps for st in kept.values() if not st.first]
    typical = statistics.median(per_step) if per_step else 0.0
    for st in kept.values():
        straggler = min(st.straggler, max(0.0, st.seconds - st.data - st.snapshot))
        # A stall: every rank waited inside a collective for a stopped (or slow there) rank, which
        # no rank's own time shows; the step's excess over the typical step is straggler wait.
        excess = st.rest - st.steps * typical
        if (
            not st.first
            and typical > 0
            and st.rest > STALL_FACTOR * st.steps * typical
            and excess >= STALL_MIN_S
        ):
            straggler += excess
        gp.productive_s += st.seconds - st.data - st.snapshot - straggler
        gp.lose("data", st.data)
        gp.lose("straggler", straggler)
        gp.lose("checkpoint", st.snapshot)
    return gp


# The fields goodput reads, by event; any other event is kept as its time only (a sign of life).
_FIELDS = {
    "launch": ("time",),
    "launch_end": ("time",),
    "attempt": ("time", "started", "step"),
    "metrics": ("time", "step", "step_time", "steps_time_s", "data_wait_s", "straggler_wait_s"),
    "checkpoint": ("time", "seconds"),
    "memory_snapshot": ("time", "stall_s"),
    "memory_snapshot_wait": ("time", "seconds"),
    "finish": ("time", "status"),
}


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of ``<run_dir>/metrics.jsonl`` that goodput reads, with only the fields it reads
    (a torn line skipped; none when there is no file)."""
    path = Path(run_dir) / "metrics.jsonl"
    out: list[dict[str, Any]] = []
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return out
    with fh:
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            name = ev.get("event")
            fields = _FIELDS.get(name, ("time",)) if isinstance(name, str) else ("time",)
            out.append(
                {"event": name if name in _FIELDS else "other", **{k: ev[k] for k in fields if k in ev}}
            )
    return out


def run_goodput(run_dir: str | Path, now: float | None = None) -> dict[str, Any] | None:
    """The goodput object of a run folder, or None when it holds no launch or step yet."""
    events = read_events(run_dir)
    if not any(e.get("event") in ("launch", "attempt", "metrics") for e in events):
        return None
    # as_of: when it was computed (a job still running counts the time since as not yet split).
    return {**compute(events, now).as_dict(), "as_of": round(time.time() if now is None else now, 3)}


def record(run_id: str, goodput: dict[str, Any]) -> None:
    """Keep a run's goodput with its database run (``system["goodput"]``: no schema change)."""
    from gpuyard.store import get_store
    from gpuyard.store.tables.models import RunRow

    with get_store().session() as s:
        row = s.get(RunRow, run_id)
        if row is not None:
            row.system = {**(row.system or {}), "goodput": goodput}


def of_run_doc(doc: dict[str, Any], live: bool = False) -> dict[str, Any] | None:
    """The goodput object of a run document (``run_details``): the one recorded at the end of its
    last launch; with ``live`` (the CLI, on the run's machine), computed from its folder when none is."""
    stored = (doc.get("system") or {}).get("goodput")
    if isinstance(stored, dict):
        return stored
    run_dir = (doc.get("tags") or {}).get("run_dir")
    if live and isinstance(run_dir, str) and (Path(run_dir) / "metrics.jsonl").is_file():
        try:
            return run_goodput(run_dir)
        except (OSError, ValueError):
            return None
    return None


def describe(goodput: dict[str, Any] | None) -> str:
    """One line: ``ETTR 91.2% of 1h02m (lost: queueing 3m10s, restart 40s, ...)``."""
    if not goodput or goodput.get("ettr") is None:
        return "-"
    lost = [(c, s) for c, s in goodput["lost_s"].items() if s >= 0.0005]
    parts = ", ".join(f"{c} {_dur(s)}" for c, s in sorted(lost, key=lambda x: -x[1]))
    head = f"ETTR {goodput['ettr'] * 100:.1f}% of {_dur(goodput['wall_s'])}"
    return head + (f" (lost: {parts})" if parts else "")


def _dur(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.0f}s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"
