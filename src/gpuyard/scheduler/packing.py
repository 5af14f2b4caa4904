"""GPU-sharing placement policies on the share model: FGD and the packing baselines.

FGD places a task where the expected fragmentation F (:mod:`gpuyard.scheduler.fragmentation`) rises
least (F after minus F before), choosing the GPU(s) on the node the same way: the direction of
steepest descent of the cluster's expected fragmentation.

``fgd`` is FGD as the paper's artifact (hkust-adsl/kubernetes-scheduler-simulator) runs it, whose
runs give the paper's figures: the mix is its "typical pods" (every task counts, CPU-only ones too,
whose fragment is the node's whole free GPU capacity; no memory; the most popular shapes covering
95% of the tasks), and the rise goes through its Kubernetes score, an integer 0-100
(:func:`fgd_node_score`), so rises a score step apart or less tie, and ties go to a random order of
the nodes. ``fgd-exact`` takes the least rise itself, on every GPU shape of the trace with memory
(CPU-only shapes left out: they change no decision there), ties to the tightest node.

Baselines: first-fit, best-fit (least CPU and GPU left after placement, equal weights, as in the
paper's baseline), random-fit, and dot-product (smallest product of normalised free and asked
resources). Within a node the baselines take the tightest GPU with room (first-fit the first,
random-fit any).

MIG tasks (:mod:`gpuyard.scheduler.gpushares`): every policy chooses the node for them as for any
task (first-fit the first, best-fit and dot-product by CPU and free MIG compute, FGD by the rise of F
its CPU and memory cause); the instances are the node's first free ones of the profile (random-fit:
any).

The same policies place the server's shares (:func:`gpuyard.scheduler.placement.place_share`) and the
simulator's (:mod:`gpuyard.scheduler.packing_replay`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.hardware.mig import COMPUTE_SLICES
from gpuyard.scheduler.fragmentation import Fragmentation, TaskMix
from gpuyard.scheduler.gpushares import FloatArray, IntArray, Placement, SharedCluster
from gpuyard.scheduler.openb import MILLI, GpuTask, mig_compute


def _gpus_on(
    cluster: SharedCluster, node: int, task: GpuTask, how: str, rng: np.random.Generator | None = None
) -> tuple[int, ...]:
    """GPUs of ``node`` for ``task``: first, tightest or random among those with room."""
    if not task.num_gpu:
        return ()
    left = cluster.left[node]
    fit = np.flatnonzero(cluster.room(task, np.array([node]))[0])
    if how == "tightest":
        fit = fit[np.argsort(left[fit], kind="stable")]
    elif how == "random" and rng is not None:
        fit = rng.permutation(fit)
    return tuple(int(g) for g in fit[: task.num_gpu])


def _pick(
    cluster: SharedCluster, node: int, task: GpuTask, how: str, rng: np.random.Generator | None = None
) -> tuple[int, ...]:
    """The GPUs (a MIG task: slices) of ``node`` for ``task``, as :func:`_gpus_on` chooses them."""
    if task.mig:
        return cluster.slices_on(node, task, rng if how == "random" else None)
    return _gpus_on(cluster, node, task, how, rng)


def _mig_free_asked(cluster: SharedCluster, task: GpuTask, idx: IntArray) -> tuple[FloatArray, float]:
    """A MIG task's view of GPU room: free MIG compute of nodes ``idx`` and the compute asked, in
    thousandths of a GPU."""
    unit = MILLI / COMPUTE_SLICES
    free: FloatArray = cluster.mig_free_compute[idx].astype(np.float64) * unit
    return free, task.num_gpu * mig_compute(task.mig) * unit


def _leftover(cluster: SharedCluster, task: GpuTask, idx: IntArray) -> FloatArray:
    """Best-fit's score of nodes ``idx``: CPU and GPU left after placing ``task``, each over the
    largest node's, weighted equally (0: full; lower is tighter). A MIG task's GPU is the free compute
    of the MIG instances."""
    cpu_max = max(1, int(cluster.cpu_cap.max()))
    gpu_max = max(1, int(cluster.gpus.max()) * MILLI)
    score: FloatArray = 0.5 * (cluster.cpu[idx] - task.cpu_milli) / cpu_max
    if task.mig:
        free, mig_asked = _mig_free_asked(cluster, task, idx)
        score += 0.5 * (free - mig_asked) / gpu_max
        return score
    asked = task.num_gpu * task.gpu_milli
    score += 0.5 * (cluster.free[idx] - asked) / gpu_max
    return score


class PackingPolicy(Protocol):
    """Chooses the node and GPUs of a task on a :class:`SharedCluster`, or None when none fits."""

    name: str

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None: ...


class FirstFit:
    """The first node (in list order) with room, its first GPUs with room."""

    name = "firstfit"

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        idx = np.flatnonzero(cluster.feasible(task))
        if not idx.size:
            return None
        node = int(idx[0])
        return node, _pick(cluster, node, task, "first")


class RandomFit:
    """A node with room drawn at random, random GPUs with room on it (seeded)."""

    name = "randomfit"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        idx = np.flatnonzero(cluster.feasible(task))
        if not idx.size:
            return None
        node = int(self.rng.choice(idx))
        return node, _pick(cluster, node, task, "random", self.rng)


class BestFit:
    """The node left with the least CPU and GPU after placement (each normalised by the largest node)."""

    name = "bestfit"

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        idx = np.flatnonzero(cluster.feasible(task))
        if not idx.size:
            return None
        node = int(idx[int(np.argmin(_leftover(cluster, task, idx)))])
        return node, _pick(cluster, node, task, "tightest")


class DotProduct:
    """The node whose normalised free CPU and GPU has the smallest dot product with the request."""

    name = "dotprod"

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        idx = np.flatnonzero(cluster.feasible(task))
        if not idx.size:
            return None
        cpu_max = max(1, int(cluster.cpu_cap.max()))
        gpu_max = max(1, int(cluster.gpus.max()) * MILLI)
        score = (task.cpu_milli / cpu_max) * (cluster.cpu[idx] / cpu_max)
        if task.mig:
            free, mig_asked = _mig_free_asked(cluster, task, idx)
            score = score + (mig_asked / gpu_max) * (free / gpu_max)
        else:
            asked = task.num_gpu * task.gpu_milli
            score = score + (asked / gpu_max) * (cluster.free[idx] / gpu_max)
        node = int(idx[int(np.argmin(score))])
        return node, _pick(cluster, node, task, "tightest")


@dataclass
class _Choices:
    stamp: IntArray  # node version the entry was computed at (-1: never)
    delta: FloatArray  # rise of F when the task shape goes there
    gpus: IntArray  # (nodes, num_gpu) GPUs chosen


class FGD:
    """Fragmentation gradient descent: the node and GPUs where the expected fragmentation rises least.

    ``score="k8s"`` scores it as the FGD artifact's Kubernetes score plugin does (``FGDScore``), and
    ``make_packing("fgd")`` gives it the artifact's typical mix (:meth:`TaskMix.typical`): each node's
    score is :func:`fgd_node_score` of its least rise, an integer 0-100 (one step is about 0.04 GPU of
    rise near 0, coarser further out); the highest score wins, equal scores go to the first node in a
    random order of the nodes drawn once per cluster from ``seed`` (the artifact's scheduler takes the
    first node name, and its simulator prefixes each name with a random rank); a share goes to the
    first GPU (index order) with the node's best score. ``score="exact"`` takes the least rise itself,
    equal rises going to the tightest node (best-fit's score); ``packing_weight`` > 0 (exact only)
    adds best-fit's score, times that many GPUs, to the rise (a blend; 0 is FGD alone).

    The rise for a task shape on a node changes only when that node does, so it is kept per shape
    and recomputed, for all stale nodes at once, when a task of that shape arrives.
    """

    name = "fgd"

    def __init__(
        self, mix: TaskMix | None, packing_weight: float = 0.0, score: str = "exact", seed: int = 0
    ) -> None:
        if score not in ("exact", "k8s"):
            raise ConfigError(f"FGD score {score!r}: exact or k8s")
        if packing_weight and score != "exact":
            raise ConfigError("FGD's blend with best-fit adds to the exact rise: score='exact'")
        self.mix = mix
        self.packing_weight = packing_weight
        self.k8s = score == "k8s"
        self.seed = seed
        if self.k8s:
            self.name = "fgd"
        elif packing_weight:
            self.name = "fgd-bf" if packing_weight == FGD_BF_WEIGHT else f"fgd-bf{packing_weight:g}"
        else:
            self.name = "fgd-exact"
        # Without a mix, it is learned from the GPU tasks it is asked to place (a task retried while
        # it waits counts again), re-estimated each time their number doubles (each estimate drops
        # what was kept: every rise depends on the mix).
        self.online = mix is None
        if self.online:
            self.name = "fgd-online" if self.name == "fgd-exact" else self.name + "-online"
        self._seen: Counter[tuple[Any, ...]] = Counter()
        self._next_estimate = 1
        self._cluster: SharedCluster | None = None
        self._frag: Fragmentation | None = None
        self._f = np.zeros(0, dtype=np.float64)
        self._f_stamp = np.zeros(0, dtype=np.int64)
        self._choices: dict[tuple[Any, ...], _Choices] = {}
        self._order = np.zeros(0, dtype=np.int64)  # k8s: each node's place in the tie-break order

    def _learn(self, task: GpuTask) -> None:
        if not task.num_gpu or task.mig:
            return
        self._seen[task.shape] += 1
        seen = sum(self._seen.values())
        if seen >= self._next_estimate:
            self.mix = TaskMix.of_counts(self._seen)
            self._next_estimate = 2 * seen
            self._frag = None

    def _bind(self, cluster: SharedCluster) -> Fragmentation | None:
        if self.mix is None:
            return None
        if self._cluster is not cluster or self._frag is None:
            if self._cluster is not cluster:
                self._order = np.random.default_rng(self.seed).permutation(len(cluster.nodes))
            self._cluster = cluster
            self._frag = Fragmentation(self.mix, cluster)
            self._f = np.zeros(len(cluster.nodes), dtype=np.float64)
            self._f_stamp = np.full(len(cluster.nodes), -1, dtype=np.int64)
            self._choices = {}
        return self._frag

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        if self.online:
            self._learn(task)
        frag = self._bind(cluster)
        if frag is None:  # learning, and no GPU task seen yet: best-fit
            return BestFit().choose(cluster, task)
        idx = np.flatnonzero(cluster.feasible(task))
        if not idx.size:
            return None
        n = len(cluster.nodes)
        choices = self._choices.get(task.shape)
        if choices is None:
            choices = _Choices(
                np.full(n, -1, dtype=np.int64),
                np.zeros(n, dtype=np.float64),
                np.zeros((n, task.num_gpu), dtype=np.int64),
            )
            self._choices[task.shape] = choices
        stale = idx[choices.stamp[idx] != cluster.version[idx]]
        if stale.size:
            old_stale = stale[self._f_stamp[stale] != cluster.version[stale]]
            if old_stale.size:
                self._f[old_stale] = frag.of_nodes(cluster, old_stale)
                self._f_stamp[old_stale] = cluster.version[old_stale]
            delta, gpus = self._rise(cluster, frag, task, stale)
            choices.delta[stale] = delta
            choices.gpus[stale] = gpus
            choices.stamp[stale] = cluster.version[stale]
        if self.k8s:
            # The highest integer score; equal ones: the first node in the random order.
            score = fgd_node_score(choices.delta[idx])
            tied = np.flatnonzero(score == score.max())
            node = int(idx[tied[int(np.argmin(self._order[idx[tied]]))]])
            return node, tuple(int(g) for g in choices.gpus[node])
        leftover = _leftover(cluster, task, idx)
        rise = choices.delta[idx] + self.packing_weight * MILLI * leftover
        # Equal rises (identical nodes, or none that matters to the mix): the tightest node, best-fit's.
        tied = np.flatnonzero(rise <= rise.min() + 1e-6)
        node = int(idx[tied[int(np.argmin(leftover[tied]))]])
        return node, tuple(int(g) for g in choices.gpus[node])

    def _rise(
        self, cluster: SharedCluster, frag: Fragmentation, task: GpuTask, nodes: IntArray
    ) -> tuple[FloatArray, IntArray]:
        """Least rise of F for ``task`` on each of ``nodes`` (all feasible), and the GPUs giving it."""
        cpu = cluster.cpu[nodes] - task.cpu_milli
        mem = cluster.mem[nodes] - task.memory_mib
        model = cluster.model[nodes]
        left = cluster.left[nodes]
        before = self._f[nodes]
        if task.mig:  # it takes CPU and memory from the shapes of the mix, no room they could use
            picks = np.array([cluster.slices_on(int(n), task) for n in nodes], dtype=np.int64)
            return frag.of_states(cpu, mem, model, left) - before, picks.reshape(len(nodes), task.num_gpu)
        if task.num_gpu == 0:
            return frag.of_states(cpu, mem, model, left) - before, np.zeros((len(nodes), 0), dtype=np.int64)
        width = left.shape[1]
        if task.num_gpu == 1:
            # One candidate per GPU with room: the task's share taken from that GPU.
            cand = np.repeat(left[:, None, :], width, axis=1)  # (nodes, candidate GPU, GPUs)
            diag = np.arange(width)
            cand[:, diag, diag] -= task.gpu_milli
            ok = cluster.room(task, nodes)
            rows, cols = np.nonzero(ok)
            after = np.full(left.shape, np.inf)
            after[rows, cols] = frag.of_states(cpu[rows], mem[rows], model[rows], cand[rows, cols])
            if self.k8s:  # the first GPU with the node's best integer score
                best = np.argmax(np.where(ok, fgd_node_score(after - before[:, None]), -1), axis=1)
            else:
                best = np.argmin(after, axis=1)
            rise = after[np.arange(len(nodes)), best] - before
            return rise, best[:, None].astype(np.int64)
        # Whole GPUs: those with full room are alike; take the first ones.
        full = cluster.room(task, nodes)
        order = np.argsort(~full, axis=1, kind="stable")[:, : task.num_gpu]
        new = left.copy()
        np.put_along_axis(new, order, np.take_along_axis(left, order, axis=1) - task.gpu_milli, axis=1)
        return frag.of_states(cpu, mem, model, new) - before, order.astype(np.int64)


def fgd_node_score(rise: FloatArray) -> IntArray:
    """The FGD artifact's node score for rises of F (GPU thousandths): ``int(100 x sigmoid(-rise /
    1000))``, truncated as its Go code converts to ``int64`` (0 rise: 50; any rise above 0: 49 or
    less). The artifact's ``calculateGpuShareFragExtendScore`` in
    ``pkg/simulator/plugin/fgd_score.go``."""
    x = np.clip(np.asarray(rise, dtype=np.float64) / MILLI, -60.0, 60.0)  # exp stays finite
    out: IntArray = np.floor(100.0 / (1.0 + np.exp(x))).astype(np.int64)
    return out


PACKING_POLICIES = {
    "fgd": "fragmentation gradient descent as the paper's artifact scores it (typical mix, 0-100 score)",
    "fgd-exact": "FGD taking the least rise itself, on every GPU shape of the trace (with memory)",
    "fgd-bf": "fgd-exact's rise plus 0.05 GPU x best-fit's leftover score (a blend)",
    "fgd-online": "fgd-exact with the task mix learned from the arrivals so far",
    "bestfit": "least CPU and GPU left after placement",
    "firstfit": "first node with room",
    "randomfit": "a random node with room",
    "dotprod": "smallest dot product of free and asked CPU/GPU",
}
FGD_BF_WEIGHT = 0.05  # GPUs per unit of best-fit's score; chosen on arrival seeds 42-44 of the openb traces


def make_packing(name: str, mix: TaskMix | None = None, seed: int = 0) -> PackingPolicy:
    """A packing policy by name (one of :data:`PACKING_POLICIES`; fgd, fgd-exact and fgd-bf need the
    task mix, fgd one made by :meth:`TaskMix.of` or :meth:`TaskMix.of_counts`; ``seed`` draws
    random-fit's choices and fgd's tie-break order).

    Raises:
        ConfigError: unknown name, or FGD without a mix.
    """
    if name == "fgd-online":
        return FGD(None)
    if name in ("fgd", "fgd-exact", "fgd-bf"):
        if mix is None:
            raise ConfigError(f"{name} needs the workload's task mix")
        if name == "fgd":
            return FGD(mix.typical(), score="k8s", seed=seed)
        return FGD(mix, FGD_BF_WEIGHT if name == "fgd-bf" else 0.0)
    if name == "bestfit":
        return BestFit()
    if name == "firstfit":
        return FirstFit()
    if name == "randomfit":
        return RandomFit(seed)
    if name == "dotprod":
        return DotProduct()
    raise ConfigError(f"packing {name!r}: choose one of {', '.join(PACKING_POLICIES)}")


_NEEDS_MIX = ("fgd", "fgd-exact", "fgd-bf", "fgd-online")


class LivePacking:
    """A packing policy by name for a scheduler that learns its workload as it runs (the server).

    FGD's task mix is the shapes of the jobs it knows (:meth:`observe`: on the server the jobs queued
    and running), estimated again when their number has doubled or halved since the last estimate (as
    fgd-online re-estimates when its arrivals double: each estimate drops FGD's kept rises, so not at
    every job); ``fgd-online`` is fgd-exact on that mix. Until a GPU job is known, FGD places as
    best-fit, as fgd-online does before its first GPU task. The other policies need no mix.

    Raises:
        ConfigError: an unknown name.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        if name not in PACKING_POLICIES:
            raise ConfigError(f"packing {name!r}: choose one of {', '.join(PACKING_POLICIES)}")
        self.name, self.seed = name, seed
        self._known = 0  # GPU jobs known at the last estimate (0: none yet)
        self.policy: PackingPolicy = BestFit() if name in _NEEDS_MIX else make_packing(name, seed=seed)

    def observe(self, counts: Counter[tuple[Any, ...]]) -> None:
        """The task shapes (``GpuTask.shape``, MIG ones left out) of the jobs known now, with counts."""
        if self.name not in _NEEDS_MIX:
            return
        known = sum(n for shape, n in counts.items() if shape[2] and n > 0)
        if known == self._known or (self._known and self._known / 2 < known < 2 * self._known):
            return
        self._known = known
        if not known:
            self.policy = BestFit()
            return
        mix = TaskMix.of_counts(Counter(counts))
        self.policy = make_packing("fgd-exact" if self.name == "fgd-online" else self.name, mix, self.seed)

    def choose(self, cluster: SharedCluster, task: GpuTask) -> Placement | None:
        """The node and GPUs (MIG: slices) for ``task``, or None when none fits."""
        return self.policy.choose(cluster, task)
