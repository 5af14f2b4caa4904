"""The one model of a cluster's GPU shares and MIG slices, for the server and the simulator alike.

A task asks for CPU, memory and either a share of one GPU (``gpu_milli`` < 1000) or whole GPUs,
possibly of given models (the openb traces, :mod:`gpuyard.scheduler.openb`), and possibly GPU
memory on each of its GPUs (``gpu_memory_mib``: the server's shares by memory). A node's GPUs are
tracked one by one in thousandths (and MiB of GPU memory where known), so shares from several tasks
can sit on one GPU. The packing policies (:mod:`gpuyard.scheduler.packing`) choose on this model; the
server's :class:`gpuyard.scheduler.placement.ClusterState` keeps its shares and slices in it.

MIG (gpuyard's addition; not in the FGD paper): a node's GPUs may be in MIG mode with a fixed layout
of instances (:attr:`GpuNode.mig <gpuyard.scheduler.openb.GpuNode>`, placed where the hardware allows,
:func:`gpuyard.hardware.mig.arrange`). Such a GPU has no room for shares or whole-GPU tasks; a MIG
task (:attr:`GpuTask.mig <gpuyard.scheduler.openb.GpuTask>`) takes ``num_gpu`` free instances of its
profile on one node, nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.hardware.mig import COMPUTE_SLICES
from gpuyard.scheduler.openb import MILLI, GpuNode, GpuTask, mig_compute

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
Placement = tuple[int, tuple[int, ...]]  # node index, GPU indexes on that node (empty: CPU only)


class SharedCluster:
    """Free CPU, memory and per-GPU thousandths of every node; ``version`` counts each node's changes.

    MIG instances are slices, numbered node by node (``slice_*`` arrays; a node's are
    ``slice_offset[n]:slice_offset[n + 1]``); a GPU in MIG mode has no thousandths free. GPU memory
    (``gmem_left``, MiB per GPU) is checked only for tasks that ask some, on nodes that know theirs.
    ``blocked`` nodes (drained) take nothing new; ``shares_on`` counts the shares (< 1000) on each GPU.
    """

    # What placing and releasing change (a copy has its own).
    _MUTABLE = (
        "cpu",
        "mem",
        "left",
        "gmem_left",
        "shares_on",
        "free",
        "version",
        "whole_gpus",
        "blocked",
        "slice_busy",
        "mig_free",
        "mig_free_compute",
    )

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
        self.gmem_cap = np.array([n.gpu_memory_mib for n in nodes], dtype=np.int64)
        self.gmem_left = np.where(self.left > 0, self.gmem_cap[:, None], 0).astype(np.int64)
        self.shares_on = np.zeros_like(self.left)
        self.blocked = np.zeros(len(nodes), dtype=np.bool_)
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

    def copy(self) -> SharedCluster:
        """A copy whose placements do not touch this one (the nodes and slice table are shared)."""
        other = object.__new__(SharedCluster)
        other.__dict__.update(self.__dict__)
        for name in self._MUTABLE:
            setattr(other, name, getattr(self, name).copy())
        return other

    def retire(self, node: int, gpu: int) -> None:
        """Take whole GPU ``gpu`` of ``node`` out of service: it failed its health check, or it is in
        MIG mode without instances. Nothing is placed on it.

        Raises:
            CapacityError: something holds part of it.
        """
        if self.left[node, gpu] != MILLI:
            raise CapacityError(f"GPU {gpu} of {self.nodes[node].name} is not a free whole GPU")
        self.left[node, gpu] = self.gmem_left[node, gpu] = 0
        self.free[node] -= MILLI
        self.whole_gpus[node] -= 1
        self.capacity_milli -= MILLI
        self.version[node] += 1

    def room(self, task: GpuTask, nodes: IntArray | None = None) -> BoolArray:
        """Per node (all, or ``nodes``) and GPU: has that GPU room for one of ``task``'s GPUs (its
        thousandths and, where the node knows its GPUs' memory, the GPU memory it asks)."""
        left = self.left if nodes is None else self.left[nodes]
        ok: BoolArray = left >= task.gpu_milli
        if task.gpu_memory_mib:
            cap = self.gmem_cap if nodes is None else self.gmem_cap[nodes]
            mem = self.gmem_left if nodes is None else self.gmem_left[nodes]
            ok &= (cap == 0)[:, None] | (mem >= task.gpu_memory_mib)
        return ok

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
        if self.blocked.any():
            ok &= ~self.blocked
        if task.mig:
            k = self._mig_index.get(task.mig)
            if k is None:
                return np.zeros(len(self.nodes), dtype=np.bool_)
            ok &= self.mig_free[:, k] >= task.num_gpu
            return ok
        if task.num_gpu:
            ok &= self.room(task).sum(axis=1) >= task.num_gpu
        return ok

    def fits_empty(self, task: GpuTask) -> bool:
        """Could ``task`` run on some node of the empty cluster."""
        ok = (self.cpu_cap >= task.cpu_milli) & (self.mem_cap >= task.memory_mib)
        ok &= self.model_ok(task.gpu_spec)[self.model]
        if task.mig:
            k = self._mig_index.get(task.mig)
            return k is not None and bool((ok & (self.mig_total[:, k] >= task.num_gpu)).any())
        ok &= self.whole_gpus >= task.num_gpu
        if task.gpu_memory_mib:
            ok &= (self.gmem_cap == 0) | (self.gmem_cap >= task.gpu_memory_mib)
        return bool(ok.any())

    def place(self, task: GpuTask, placement: Placement, force: bool = False) -> None:
        """Take ``task``'s resources on ``placement``; with ``force`` even past what is free (what
        already runs there, as its records say: a GPU may have failed its health check since).

        Raises:
            CapacityError: they are not free there (not raised with ``force``).
        """
        node, gpus = placement
        if len(gpus) != task.num_gpu or len(set(gpus)) != len(gpus):
            raise CapacityError(f"{task.name}: {len(gpus)} GPUs given for num_gpu {task.num_gpu}")
        if force:
            self._take(task, node, gpus)
            return
        if self.cpu[node] < task.cpu_milli or self.mem[node] < task.memory_mib:
            raise CapacityError(f"{task.name}: not enough CPU or memory on {self.nodes[node].name}")
        if not self.model_ok(task.gpu_spec)[self.model[node]]:
            raise CapacityError(f"{task.name}: GPU model {self.nodes[node].model} not in {task.gpu_spec}")
        if task.mig:
            self._take_slices(task, node, gpus)
            return
        mem = task.gpu_memory_mib if self.gmem_cap[node] else 0
        for g in gpus:
            if g >= self.gpus[node] or self.left[node, g] < task.gpu_milli or self.gmem_left[node, g] < mem:
                raise CapacityError(f"{task.name}: GPU {g} of {self.nodes[node].name} has no room")
        self._take(task, node, gpus)

    def _take(self, task: GpuTask, node: int, gpus: tuple[int, ...]) -> None:
        if task.mig:
            self._mark_slices(node, self._mig_index[task.mig], gpus, busy=True)
            self.cpu[node] -= task.cpu_milli
            self.mem[node] -= task.memory_mib
            return
        mem = task.gpu_memory_mib if self.gmem_cap[node] else 0
        self.cpu[node] -= task.cpu_milli
        self.mem[node] -= task.memory_mib
        for g in gpus:
            self.left[node, g] -= task.gpu_milli
            self.gmem_left[node, g] -= mem
            self.shares_on[node, g] += task.gpu_milli < MILLI
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
        self._take(task, node, slices)

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
        mem = task.gpu_memory_mib if self.gmem_cap[node] else 0
        for g in gpus:
            self.left[node, g] += task.gpu_milli
            self.gmem_left[node, g] += mem
            self.shares_on[node, g] -= task.gpu_milli < MILLI
        self.free[node] += task.num_gpu * task.gpu_milli
        self.allocated_milli -= task.num_gpu * task.gpu_milli
        self.version[node] += 1
