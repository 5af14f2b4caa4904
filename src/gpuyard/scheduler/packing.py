"""GPU-sharing placement in the simulator: shares of GPUs, fragmentation, FGD and packing baselines.

A task asks for CPU, memory and either a share of one GPU (``gpu_milli`` < 1000) or whole GPUs,
possibly of given models (the openb traces, :mod:`gpuyard.scheduler.openb`). A node's GPUs are
tracked one by one in thousandths, so shares from several tasks can sit on one GPU.

Fragmentation, after FGD (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads
with Fragmentation Gradient Descent", USENIX ATC'23), measured against the workload's mix of task
shapes M, each with popularity p_m:

* for one task shape m, the fragment of node n is the GPU capacity left on n that m cannot use:
  all of it when m cannot run on n at all (CPU, memory, GPU model, or too few GPUs with room),
  else the capacity left on the GPUs with less room than m's per-GPU demand;
* the node's fragmentation is the expected fragment F_n = sum_m p_m frag_n(m);
* FGD places a task where F rises least (F after minus F before), choosing the GPU(s) on the node
  the same way: the direction of steepest descent of the cluster's expected fragmentation.

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
random-fit any). ``fill`` runs the paper's experiment (tasks arrive until the cluster is full,
measuring unallocated GPU capacity), ``replay`` a trace with durations (JCT).

MIG (gpuyard's addition; not in the paper): a node's GPUs may be in MIG mode with a fixed layout of
instances (:attr:`GpuNode.mig <gpuyard.scheduler.openb.GpuNode>`, placed where the hardware allows,
:func:`gpuyard.hardware.mig.arrange`). Such a GPU has no room for shares or whole-GPU tasks; a MIG
task (:attr:`GpuTask.mig <gpuyard.scheduler.openb.GpuTask>`) takes ``num_gpu`` free instances of its
profile on one node, nothing else. Every policy chooses the node for it as for any task (first-fit
the first, best-fit and dot-product by CPU and free MIG compute, FGD by the rise of F its CPU and
memory cause); the instances are the node's first free ones of the profile (random-fit: any). MIG
tasks are left out of FGD's mix: F measures the room for shares and whole GPUs, which they never use.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.hardware.mig import COMPUTE_SLICES
from gpuyard.scheduler.openb import MILLI, GpuNode, GpuTask, mig_compute

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
Placement = tuple[int, tuple[int, ...]]  # node index, GPU indexes on that node (empty: CPU only)
TYPICAL_POPULARITY = 0.95  # the FGD artifact's experiments: shapes covering 95% of the tasks


class SharedCluster:
    """Free CPU, memory and per-GPU thousandths of every node; ``version`` counts each node's changes.

    MIG instances are slices, numbered node by node (``slice_*`` arrays; a node's are
    ``slice_offset[n]:slice_offset[n + 1]``); a GPU in MIG mode has no thousandths free.
    """

    def __init__(self, nodes: Sequence[GpuNode]) -> None:
        if not nodes:
            raise ConfigError("a cluster needs at least one node")
        self.nodes = list(nodes)
        self.gpus = np.array([n.gpus for n in nodes], dtype=np.int64)
        width = max(1, int(self.gpus.max()))
        self.cpu_cap = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        self.mem_cap = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        self.cpu = self.cpu_cap.copy()
        self.mem = self.mem_cap.copy()
        # Missing GPUs of a smaller node are columns with 0 left: they never fit and add no fragment.
        self.left = np.zeros((len(nodes), width), dtype=np.int64)
        for i, n in enumerate(nodes):
            self.left[i, : n.gpus] = MILLI
        self.models = sorted({n.model for n in nodes})
        self.model = np.array([self.models.index(n.model) for n in nodes], dtype=np.int64)
        self._init_mig(nodes)
        self.free = self.left.sum(axis=1)  # GPU thousandths free per node
        self.version = np.zeros(len(nodes), dtype=np.int64)
        self.capacity_milli = int(self.gpus.sum()) * MILLI
        self.allocated_milli = 0
        self._spec_ok: dict[tuple[str, ...], BoolArray] = {}

    def _init_mig(self, nodes: Sequence[GpuNode]) -> None:
        """The MIG slices of ``nodes``; their GPUs lose their thousandths."""
        self.mig_profiles = sorted({name for n in nodes for gpu in n.mig for name, _ in gpu})
        self._mig_index = {name: k for k, name in enumerate(self.mig_profiles)}
        self.mig_gpus = np.zeros(len(nodes), dtype=np.int64)  # GPUs in MIG mode per node
        where: list[tuple[int, int, int, int]] = []  # node, GPU, profile index, first memory slice
        offset = [0]
        for i, n in enumerate(nodes):
            if n.mig and len(n.mig) != n.gpus:
                raise ConfigError(f"node {n.name}: a MIG layout of {len(n.mig)} GPUs for {n.gpus} GPUs")
            for g, instances in enumerate(n.mig):
                if instances:
                    self.left[i, g] = 0
                    self.mig_gpus[i] += 1
                    where += [(i, g, self._mig_index[name], start) for name, start in instances]
            offset.append(len(where))
        table = np.array(where, dtype=np.int64).reshape(-1, 4)
        self.slice_offset = np.array(offset, dtype=np.int64)
        self.slice_node, self.slice_gpu, self.slice_profile, self.slice_start = table.T.copy()
        self.slice_compute = np.array(
            [mig_compute(self.mig_profiles[k]) for k in self.slice_profile], dtype=np.int64
        )
        self.slice_busy = np.zeros(len(table), dtype=np.bool_)
        self.mig_total = np.zeros((len(nodes), max(1, len(self.mig_profiles))), dtype=np.int64)
        np.add.at(self.mig_total, (self.slice_node, self.slice_profile), 1)
        self.mig_free = self.mig_total.copy()  # free slices per node and profile
        self.mig_free_compute = np.bincount(self.slice_node, self.slice_compute, len(nodes)).astype(np.int64)
        self.mig_capacity = int(self.mig_gpus.sum()) * COMPUTE_SLICES  # compute slices of MIG GPUs
        self.mig_allocated = 0  # compute slices held by MIG tasks
        self.whole_gpus = self.gpus - self.mig_gpus  # GPUs that shares and whole-GPU tasks can use

    @property
    def has_mig(self) -> bool:
        """Some GPU is in MIG mode."""
        return bool(self.slice_node.size)

    @property
    def unallocated(self) -> float:
        """Fraction of the cluster's GPU capacity not allocated to any task (a MIG instance held
        counts its compute slices over 7; MIG compute no instance covers is never allocated)."""
        if not self.capacity_milli:
            return 0.0
        if not self.mig_allocated:
            return 1.0 - self.allocated_milli / self.capacity_milli
        return (
            1.0 - (self.allocated_milli + self.mig_allocated * MILLI / COMPUTE_SLICES) / self.capacity_milli
        )

    @property
    def mig_unallocated(self) -> float:
        """Fraction of the compute slices of the GPUs in MIG mode not held by a task (nan: none)."""
        return 1.0 - self.mig_allocated / self.mig_capacity if self.mig_capacity else math.nan

    @property
    def free_slices(self) -> int:
        """MIG slices no task holds."""
        return int((~self.slice_busy).sum())

    def slices_on(self, node: int, task: GpuTask, rng: np.random.Generator | None = None) -> tuple[int, ...]:
        """``task.num_gpu`` free slices of ``task.mig`` on ``node``: the first ones (GPU order, then
        memory slice), or drawn with ``rng``; fewer when there are not as many."""
        lo, hi = int(self.slice_offset[node]), int(self.slice_offset[node + 1])
        k = self._mig_index.get(task.mig, -1)
        ids = lo + np.flatnonzero((self.slice_profile[lo:hi] == k) & ~self.slice_busy[lo:hi])
        if rng is not None:
            ids = rng.permutation(ids)
        return tuple(int(i) for i in ids[: task.num_gpu])

    def never_fits(self, task: GpuTask) -> str | None:
        """Why ``task`` could not start even on the empty cluster (one line), or None when it could."""
        if self.fits_empty(task):
            return None
        if task.mig:
            k = self._mig_index.get(task.mig)
            have = ", ".join(
                f"{p} x{int(self.mig_total[:, j].sum())}" for j, p in enumerate(self.mig_profiles)
            )
            if k is None:
                return (
                    f"mig {task.mig}: no GPU here has a {task.mig} slice; MIG slices here: {have or 'none'}"
                )
            most = int(self.mig_total[:, k].max())
            if most < task.num_gpu:
                return f"mig {task.mig}: {task.num_gpu} slices asked, a node here has at most {most}"
        elif task.num_gpu and int(self.whole_gpus.max()) < task.num_gpu:
            if not self.whole_gpus.any():
                return "no GPU here can be shared or given whole: each is in MIG mode"
            most = int(self.whole_gpus.max())
            return f"{task.num_gpu} GPUs asked, a node here has at most {most} not in MIG mode"
        spec = f", GPU model in {'|'.join(task.gpu_spec)}" if task.gpu_spec else ""
        return f"no node has {task.cpu_milli} CPU millicores, {task.memory_mib} MiB{spec} and the GPUs asked"

    def model_ok(self, spec: tuple[str, ...]) -> BoolArray:
        """Per model index: may a task of GPU models ``spec`` (empty: any) run there."""
        ok = self._spec_ok.get(spec)
        if ok is None:
            ok = np.array([not spec or m in spec for m in self.models], dtype=np.bool_)
            self._spec_ok[spec] = ok
        return ok

    def feasible(self, task: GpuTask) -> BoolArray:
        """Per node: can ``task`` start there now."""
        ok: BoolArray = (self.cpu >= task.cpu_milli) & (self.mem >= task.memory_mib)
        ok &= self.model_ok(task.gpu_spec)[self.model]
        if task.mig:
            k = self._mig_index.get(task.mig)
            if k is None:
                return np.zeros(len(self.nodes), dtype=np.bool_)
            ok &= self.mig_free[:, k] >= task.num_gpu
            return ok
        if task.num_gpu:
            ok &= (self.left >= task.gpu_milli).sum(axis=1) >= task.num_gpu
        return ok

    def fits_empty(self, task: GpuTask) -> bool:
        """Could ``task`` run on some node of the empty cluster."""
        ok = (self.cpu_cap >= task.cpu_milli) & (self.mem_cap >= task.memory_mib)
        ok &= self.model_ok(task.gpu_spec)[self.model]
        if task.mig:
            k = self._mig_index.get(task.mig)
            return k is not None and bool((ok & (self.mig_total[:, k] >= task.num_gpu)).any())
        ok &= self.whole_gpus >= task.num_gpu
        return bool(ok.any())

    def place(self, task: GpuTask, placement: Placement) -> None:
        """Take ``task``'s resources on ``placement``.

        Raises:
            CapacityError: they are not free there.
        """
        node, gpus = placement
        if len(gpus) != task.num_gpu or len(set(gpus)) != len(gpus):
            raise CapacityError(f"{task.name}: {len(gpus)} GPUs given for num_gpu {task.num_gpu}")
        if self.cpu[node] < task.cpu_milli or self.mem[node] < task.memory_mib:
            raise CapacityError(f"{task.name}: not enough CPU or memory on {self.nodes[node].name}")
        if not self.model_ok(task.gpu_spec)[self.model[node]]:
            raise CapacityError(f"{task.name}: GPU model {self.nodes[node].model} not in {task.gpu_spec}")
        if task.mig:
            self._take_slices(task, node, gpus)
            return
        for g in gpus:
            if g >= self.gpus[node] or self.left[node, g] < task.gpu_milli:
                raise CapacityError(f"{task.name}: GPU {g} of {self.nodes[node].name} has no room")
        self.cpu[node] -= task.cpu_milli
        self.mem[node] -= task.memory_mib
        for g in gpus:
            self.left[node, g] -= task.gpu_milli
        self.free[node] -= task.num_gpu * task.gpu_milli
        self.allocated_milli += task.num_gpu * task.gpu_milli
        self.version[node] += 1

    def _take_slices(self, task: GpuTask, node: int, slices: tuple[int, ...]) -> None:
        k = self._mig_index.get(task.mig, -1)
        for s in slices:
            if not (
                0 <= s < len(self.slice_node)
                and self.slice_node[s] == node
                and self.slice_profile[s] == k
                and not self.slice_busy[s]
            ):
                raise CapacityError(
                    f"{task.name}: slice {s} is no free {task.mig} slice of {self.nodes[node].name}"
                )
        self.cpu[node] -= task.cpu_milli
        self.mem[node] -= task.memory_mib
        self._mark_slices(node, k, slices, busy=True)

    def _mark_slices(self, node: int, k: int, slices: tuple[int, ...], busy: bool) -> None:
        ids = np.array(slices, dtype=np.int64)
        self.slice_busy[ids] = busy
        compute = int(self.slice_compute[ids].sum())
        sign = 1 if busy else -1
        self.mig_free[node, k] -= sign * len(ids)
        self.mig_free_compute[node] -= sign * compute
        self.mig_allocated += sign * compute
        self.version[node] += 1

    def release(self, task: GpuTask, placement: Placement) -> None:
        """Give back what :meth:`place` took."""
        node, gpus = placement
        self.cpu[node] += task.cpu_milli
        self.mem[node] += task.memory_mib
        if task.mig:
            self._mark_slices(node, self._mig_index[task.mig], gpus, busy=False)
            return
        for g in gpus:
            self.left[node, g] += task.gpu_milli
        self.free[node] += task.num_gpu * task.gpu_milli
        self.allocated_milli -= task.num_gpu * task.gpu_milli
        self.version[node] += 1


@dataclass(frozen=True)
class TaskMix:
    """The workload's task shapes and their popularity (fractions of the tasks counted, summing to 1).

    ``counts`` keeps every shape of the tasks the mix was made from, CPU-only ones included, with
    its number of tasks (what :meth:`typical` derives the FGD artifact's mix from).
    """

    cpu: IntArray
    mem: IntArray
    num_gpu: IntArray
    milli: IntArray
    spec: tuple[tuple[str, ...], ...]
    p: FloatArray
    counts: tuple[tuple[tuple[Any, ...], int], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, tasks: Sequence[GpuTask]) -> TaskMix:
        """The mix of ``tasks``' GPU shapes, popularity by count (CPU-only shapes are left out, and
        MIG tasks: they never use the room F measures).

        Raises:
            ConfigError: no task asks for a GPU.
        """
        return cls.of_counts(Counter(t.shape for t in tasks if not t.mig))

    @classmethod
    def of_counts(cls, counts: Counter[tuple[Any, ...]]) -> TaskMix:
        """The mix of GPU shapes counted in ``counts`` (shape -> tasks; CPU-only shapes are dropped
        from the mix, kept in ``counts``).

        Raises:
            ConfigError: no GPU shape.
        """
        gpu = Counter({shape: n for shape, n in counts.items() if shape[2] and n > 0})
        if not gpu:
            raise ConfigError("no task asks for a GPU: the fragmentation measure needs GPU tasks")
        return cls._make(gpu, counts)

    @classmethod
    def _make(cls, kept: Counter[tuple[Any, ...]], every: Counter[tuple[Any, ...]]) -> TaskMix:
        shapes = sorted(kept)
        total = sum(kept.values())
        return cls(
            cpu=np.array([s[0] for s in shapes], dtype=np.int64),
            mem=np.array([s[1] for s in shapes], dtype=np.int64),
            num_gpu=np.array([s[2] for s in shapes], dtype=np.int64),
            milli=np.array([s[3] for s in shapes], dtype=np.int64),
            spec=tuple(s[4] for s in shapes),
            p=np.array([kept[s] / total for s in shapes], dtype=np.float64),
            counts=tuple(sorted((s, n) for s, n in every.items() if n > 0)),
        )

    def typical(self, popularity: float = TYPICAL_POPULARITY) -> TaskMix:
        """The FGD artifact's "typical pods" (``GetTypicalPods`` in its ``pkg/utils/frag.go``, with
        the settings of its experiments): every task counts, CPU-only ones too; a shape is (CPU,
        GPUs, thousandths per GPU, models), memory left out; the most popular shapes are kept until
        they cover ``popularity`` of the tasks, and their popularity renormalised over them.

        Raises:
            ConfigError: the mix keeps no task counts (made by hand), or they have no GPU shape.
        """
        every: Counter[tuple[Any, ...]] = Counter()
        for (cpu, _mem, num_gpu, milli, spec), n in self.counts:
            every[(cpu, 0, num_gpu, milli, spec)] += n
        if not any(s[2] for s in every):
            raise ConfigError("no task counts with a GPU: the typical mix needs the tasks' shapes")
        # Most tasks first; among equal counts the artifact's order (larger CPU, thousandths, GPUs).
        order = sorted(every, key=lambda s: (-every[s], -s[0], -s[3], -s[2], "|".join(s[4])))
        total = sum(every.values())
        kept: Counter[tuple[Any, ...]] = Counter()
        for shape in order:
            if sum(kept.values()) >= popularity * total:
                break
            kept[shape] = every[shape]
        return TaskMix._make(kept, every)

    def __len__(self) -> int:
        return len(self.p)


class Fragmentation:
    """Expected fragmentation F of node states against a :class:`TaskMix`, on one cluster's models."""

    def __init__(self, mix: TaskMix, cluster: SharedCluster) -> None:
        self.mix = mix
        self.demands = np.unique(mix.milli)
        self.didx = np.searchsorted(self.demands, mix.milli)
        self.allowed = np.stack([cluster.model_ok(s) for s in mix.spec], axis=1)  # (models, shapes)

    def of_states(self, cpu: IntArray, mem: IntArray, model: IntArray, left: IntArray) -> FloatArray:
        """F (GPU thousandths) of each state: free CPU, memory, model index and per-GPU room (rows)."""
        if left.shape[0] == 0:
            return np.zeros(0, dtype=np.float64)
        if left.shape[0] > 64:  # many nodes are alike (same model, both empty): evaluate each state once
            rows = np.column_stack([cpu, mem, model, left])
            mix_in = np.arange(1, rows.shape[1] + 1, dtype=np.int64) * np.int64(0x9E3779B97F4A7C15 >> 2)
            _, first, inverse = np.unique(rows @ mix_in, return_index=True, return_inverse=True)
            uniq = rows[first]
            # A hash of each row finds the alike ones; the check keeps it exact (else no shortcut).
            if len(uniq) < 0.8 * len(rows) and np.array_equal(uniq[inverse.ravel()], rows):
                once = self._of_distinct(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3:])
                out: FloatArray = once[inverse.ravel()]
                return out
        return self._of_distinct(cpu, mem, model, left)

    def _of_distinct(self, cpu: IntArray, mem: IntArray, model: IntArray, left: IntArray) -> FloatArray:
        states, width = left.shape
        total = left.sum(axis=1)
        # A GPU's bucket b is how many demands it has room for: it fits demand j exactly when j < b.
        nb = len(self.demands) + 1
        bucket = np.searchsorted(self.demands, left, side="right")
        flat = (np.arange(states)[:, None] * nb + bucket).ravel()
        per_bucket = np.bincount(flat, minlength=states * nb).reshape(states, nb)
        room_in = np.bincount(flat, weights=left.ravel(), minlength=states * nb).reshape(states, nb)
        count = width - np.cumsum(per_bucket, axis=1)[:, :-1]  # GPUs with room for each demand
        small = np.cumsum(room_in, axis=1)[:, :-1]  # room on the GPUs too small for each demand
        m = self.mix
        fits = (cpu[:, None] >= m.cpu[None, :]) & (mem[:, None] >= m.mem[None, :])
        fits &= self.allowed[model]
        fits &= count[:, self.didx] >= m.num_gpu[None, :]
        fits &= (m.num_gpu > 0)[None, :]  # a CPU-only shape uses no GPU: all free GPU is lost to it
        frag = np.where(fits, small[:, self.didx], total[:, None].astype(np.float64))
        # Rounded so that equal states tie exactly, however many rows the product was computed with.
        out: FloatArray = np.round(frag @ m.p, 6)
        return out

    def of_nodes(self, cluster: SharedCluster, nodes: IntArray | None = None) -> FloatArray:
        """F of the cluster's nodes as they are now (all, or those indexed by ``nodes``)."""
        idx = np.arange(len(cluster.nodes)) if nodes is None else nodes
        return self.of_states(cluster.cpu[idx], cluster.mem[idx], cluster.model[idx], cluster.left[idx])


def fragmentation_rate(cluster: SharedCluster, mix: TaskMix) -> float:
    """The cluster's expected fragment as a fraction of its GPU capacity."""
    return float(Fragmentation(mix, cluster).of_nodes(cluster).sum()) / cluster.capacity_milli


def _gpus_on(
    left: IntArray, task: GpuTask, how: str, rng: np.random.Generator | None = None
) -> tuple[int, ...]:
    """GPUs of one node (its row of room) for ``task``: first, tightest or random among those with room."""
    if not task.num_gpu:
        return ()
    fit = np.flatnonzero(left >= task.gpu_milli)
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
    return _gpus_on(cluster.left[node], task, how, rng)


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
            ok = left >= task.gpu_milli
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
        full = left >= task.gpu_milli
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
