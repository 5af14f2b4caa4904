"""Straggler detection: per-step data, compute and collective-wait times of every rank, compared.

Every rank measures, for each optimizer step:

* ``data_s``: waiting for its batches (the loader's ``next``);
* ``compute_s``: forward, backward and update, less the time blocked in DDP's gradient all-reduce
  (measured by a comm hook: from the last bucket handed to the all-reduce, which is when this
  rank's backward is done, to the end of backward);
* ``collective_s``: that all-reduce wait, plus the wait in the previous step's loss agreement.

The times ride on the all-reduce the trainer already makes each step (3 floats per rank), so
every rank has everyone's; rank 0 feeds them to :class:`StragglerDetector`.

The rule (thresholds from ``spec.straggler``):

1. A rank is *slower at a step* when its own time (data + compute) exceeds the median of the
   other ranks' by a factor of ``slowdown`` and by at least ``min_seconds``. The cause that step is
   ``data`` when its data time exceeds the others' median by more than its compute time does,
   else ``compute``.
2. When no rank is slower at a step, a rank whose collective wait exceeds the other ranks' median
   the same way is slower at that step with cause ``link`` (it waits in collectives while no rank
   keeps it waiting with work of its own).
3. A rank *stays slower*, and is named, when it was slower at ``min_fraction`` of the last
   ``window`` steps; the cause named is the most frequent among those steps, the slowdown the
   median ratio. It is named once, and again only after it has dropped below half that fraction.

Known blind spots: in a symmetric collective (a ring all-reduce over 2 ranks) a slow link slows
every rank alike and rule 2 cannot say whose link it is; under FSDP, tensor or pipeline parallel
the collectives inside forward and backward are not separated from compute.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Any

from gpuyard.states import straggler_measured as measured


@dataclass(frozen=True)
class StepTimes:
    """One rank's times for one step, in seconds."""

    data_s: float
    compute_s: float
    collective_s: float

    @property
    def own_s(self) -> float:
        """Time this rank spent on its own work (the rest is waiting for others)."""
        return self.data_s + self.compute_s


@dataclass(frozen=True)
class Straggler:
    """A rank named as staying slower: the step it was named at, why, and by how much."""

    rank: int
    cause: str  # data | compute | link
    step: int
    slowdown: float  # its time / the other ranks' median (own time; collective wait for link)
    slow_steps: int  # steps it was slower at, of the last `window`
    window: int
    data_s: float  # medians over its slower steps
    compute_s: float
    collective_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        return (
            f"rank {self.rank} is a straggler ({self.cause}): {measured(self.cause, self.slowdown)} at "
            f"{self.slow_steps} of the last {self.window} steps (step {self.step}; "
            f"data {self.data_s * 1e3:.1f} ms, compute {self.compute_s * 1e3:.1f} ms, "
            f"collective wait {self.collective_s * 1e3:.1f} ms)"
        )


def others_medians(values: list[float]) -> list[float]:
    """For each index, the median of the other values (O(n log n) for all of them, not O(n^2))."""
    n = len(values) - 1
    order = sorted(range(len(values)), key=values.__getitem__)
    ranked = [values[i] for i in order]
    out = [0.0] * len(values)
    for pos, i in enumerate(order):

        def kth(k: int, pos: int = pos) -> float:  # k-th smallest once ranked[pos] is left out
            return ranked[k] if k < pos else ranked[k + 1]

        out[i] = kth(n // 2) if n % 2 else (kth(n // 2 - 1) + kth(n // 2)) / 2
    return out


def slower_at_step(
    times: list[StepTimes], slowdown: float, min_seconds: float
) -> dict[int, tuple[str, float]]:
    """Rules 1 and 2 for one step: {rank: (cause, ratio)} of the ranks slower at it."""
    if len(times) < 2:
        return {}
    own_ref = others_medians([t.own_s for t in times])
    out: dict[int, tuple[str, float]] = {}
    slow = [
        r
        for r, t in enumerate(times)
        if t.own_s > slowdown * own_ref[r] and t.own_s - own_ref[r] >= min_seconds
    ]
    if slow:
        data_ref = others_medians([t.data_s for t in times])
        compute_ref = others_medians([t.compute_s for t in times])
        for r in slow:
            t, ref = times[r], own_ref[r]
            cause = "data" if t.data_s - data_ref[r] > t.compute_s - compute_ref[r] else "compute"
            out[r] = (cause, t.own_s / ref if ref > 0 else float("inf"))
        return out
    wait_ref = others_medians([t.collective_s for t in times])
    for r, t in enumerate(times):
        ref = wait_ref[r]
        if t.collective_s > slowdown * ref and t.collective_s - ref >= min_seconds:
            out[r] = ("link", t.collective_s / ref if ref > 0 else float("inf"))
    return out


class StragglerDetector:
    """Applies the rule over a sliding window of steps (see the module); :meth:`observe` per step."""

    def __init__(
        self,
        world_size: int,
        window: int = 20,
        min_fraction: float = 0.75,
        slowdown: float = 1.2,
        min_seconds: float = 0.005,
    ) -> None:
        self.world_size = world_size
        self.window = window
        self.needed = max(1, round(min_fraction * window))
        self.slowdown, self.min_seconds = slowdown, min_seconds
        self._steps: deque[tuple[dict[int, tuple[str, float]], list[StepTimes]]] = deque()
        self._counts: Counter[int] = Counter()  # rank -> steps of the window it was slower at
        self._named: dict[int, str] = {}  # rank -> cause, while it stays named
        self.found: list[Straggler] = []

    def observe(self, step: int, times: list[StepTimes]) -> list[Straggler]:
        """Add one step's times (indexed by rank); returns the ranks newly named at this step."""
        slower = slower_at_step(times, self.slowdown, self.min_seconds)
        self._steps.append((slower, times))
        self._counts.update(slower.keys())
        if len(self._steps) > self.window:
            old, _ = self._steps.popleft()
            self._counts.subtract(old.keys())
        for r in [r for r in self._named if self._counts[r] < self.needed / 2]:
            del self._named[r]  # recovered: may be named again later
        if len(self._steps) < self.window:
            return []
        new = []
        # Only ranks slower at enough steps are looked at: O(window) each, not O(world x window).
        for r in sorted(r for r, n in self._counts.items() if n >= self.needed):
            verdicts = [(s[r], t[r]) for s, t in self._steps if r in s]
            cause = Counter(c for (c, _), _ in verdicts).most_common(1)[0][0]
            if self._named.get(r) == cause:
                continue
            self._named[r] = cause
            found = Straggler(
                rank=r,
                cause=cause,
                step=step,
                slowdown=round(statistics.median(ratio for (_, ratio), _ in verdicts), 3),
                slow_steps=len(verdicts),
                window=self.window,
                data_s=round(statistics.median(t.data_s for _, t in verdicts), 6),
                compute_s=round(statistics.median(t.compute_s for _, t in verdicts), 6),
                collective_s=round(statistics.median(t.collective_s for _, t in verdicts), 6),
            )
            self.found.append(found)
            new.append(found)
        return new


class CommTimer:
    """A DDP comm hook that notes when this rank hands its last gradient bucket to the all-reduce.

    ``wait_since_launch()`` right after backward is the time blocked in the gradient all-reduce
    (waiting for the other ranks and the transfer), not spent computing.
    """

    def __init__(self) -> None:
        self.last_launch: float | None = None
        # DDP checks a hook's annotations against its own classes, which string annotations
        # (``from __future__ import annotations``) never match: the hook it gets has none.
        self.hook = lambda process_group, bucket: self._launch(process_group, bucket)

    def _launch(self, process_group: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.last_launch = time.perf_counter()
        return default_hooks.allreduce_hook(process_group, bucket)

    def wait_since_launch(self) -> float:
        """Seconds since the last bucket was launched (0 when none was this step); resets."""
        if self.last_launch is None:
            return 0.0
        waited = time.perf_counter() - self.last_launch
        self.last_launch = None
        return waited


class SchedulerReporter:
    """Sends each named straggler to the scheduler that runs this job, with the job's own token.

    Active only in a job of `gpuyard server` (``GPUYARD_JOB_ID``, ``GPUYARD_SERVER`` and
    ``GPUYARD_TOKEN`` set): ``POST /jobs/ID/stragglers`` with the rank, the scheduler's name of its node
    (``GPUYARD_NODE`` of each rank, gathered at start; else its host name), the cause, the slowdown and
    the step. The server records an event on the job and, with ``on_straggler: restart``, restarts the
    job without that node when it can. Sent from a background thread with a short timeout: a server
    that does not answer never holds up training; a failure is one line on stderr.
    """

    def __init__(self, nodes: list[str], env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.nodes = nodes
        self.url = env.get("GPUYARD_SERVER", "").rstrip("/")
        self.token = env.get("GPUYARD_TOKEN", "")
        self.job_id = env.get("GPUYARD_JOB_ID", "")
        self.sent: list[threading.Thread] = []

    @property
    def active(self) -> bool:
        """Whether this job reports to a scheduler."""
        return bool(self.url and self.token and self.job_id.isdigit())

    def body(self, found: Straggler) -> dict[str, Any]:
        """The report of one straggler."""
        node = self.nodes[found.rank] if found.rank < len(self.nodes) else "unknown"
        return {
            "rank": found.rank,
            "node": node,
            "cause": found.cause,
            "slowdown": round(found.slowdown, 4),
            "step": found.step,
        }

    def report(self, found: Straggler) -> None:
        """Send ``found`` in the background (nothing without a scheduler)."""
        if not self.active:
            return
        thread = threading.Thread(target=self._post, args=(self.body(found),), daemon=True)
        thread.start()
        self.sent.append(thread)

    def _post(self, body: dict[str, Any]) -> None:
        import httpx

        url = f"{self.url}/jobs/{self.job_id}/stragglers"
        try:
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {self.token}"}, timeout=5.0)
            r.raise_for_status()
            print(f"gpuyard train: scheduler: {r.json().get('reason', '')}", file=sys.stderr, flush=True)
        except (httpx.HTTPError, ValueError) as exc:
            print(
                f"gpuyard train: could not report the straggler to {url}: {exc}", file=sys.stderr, flush=True
            )


def node_name(env: dict[str, str] | None = None) -> str:
    """The scheduler's name of this process's node (``GPUYARD_NODE``), else the host name."""
    env = dict(os.environ) if env is None else env
    return env.get("GPUYARD_NODE") or socket.gethostname()
