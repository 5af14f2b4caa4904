"""Gang, topology-aware placement on plain cluster data, shared by the server and the simulator.

The cluster is a list of :class:`NodeSpec` (GPU slots, GPU type, NVLink domain, leaf switch,
health-excluded GPUs). :class:`ClusterState` keeps the free slots in NumPy arrays so a decision costs
a few vector operations, and :func:`place` picks the GPUs of one job, all of them or none (gang):

1. a job that fits on one node goes to the node with the *fewest* free GPUs that still fits it
   (best fit: whole nodes stay free for big jobs, which keeps fragmentation low);
2. a job that fits inside one multi-node NVLink domain (GB200 NVL72) stays inside the fullest such
   domain that fits it;
3. otherwise the fewest nodes under one leaf switch (whole free nodes first, the remainder best fit);
4. only when no leaf can hold it, the fewest nodes across leaves.

Nodes can be drained (:meth:`ClusterState.set_drained`, node health): :func:`place` puts nothing on
them and their free slots do not count as free.

Sharing (:class:`GpuShare`): a job may ask for part of one GPU (a fraction and/or GPU memory) or for
MIG slices of one profile. The shares and slices are kept in the share model the simulator and the
benchmarks use (:class:`gpuyard.scheduler.gpushares.SharedCluster`: per GPU, thousandths of its
compute and MiB of its memory; per MIG slice, held or not), and placed by the same packing policy
(:mod:`gpuyard.scheduler.packing`, FGD by default); a GPU with any share is no longer free for
whole-GPU jobs. GPUs in MIG mode are never handed out whole: only their slices, each to one job. See
:func:`place_share`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.hardware.mig import PROFILE_NAMES
from gpuyard.scheduler.gpushares import SharedCluster
from gpuyard.scheduler.openb import MILLI, GpuNode, GpuTask
from gpuyard.scheduler.packing import LivePacking

_BIG = np.iinfo(np.int64).max
# Records keep fractions to 6 decimals and GiB to 3: sums of recorded shares may pass the exact
# figure by that rounding, so comparisons allow it (1e-5 of a GPU, about 10 MiB).
_EPS = 1e-5
_MEM_EPS = 0.01
DEFAULT_PACKING = "fgd-online"  # the server's share placement (ServiceConfig.packing, --packing)


@dataclass(frozen=True)
class MigSlice:
    """One MIG device of a node: its GPU, its profile (``1g.10gb``) and its ``MIG-...`` UUID."""

    gpu: int
    profile: str
    uuid: str


@dataclass(frozen=True)
class NodeSpec:
    """One node as the scheduler sees it.

    Attributes:
        name: host name (unique).
        gpus: GPU slots on the node (healthy or not).
        gpu_type: accelerator name, e.g. "A100-80GB"; "" when the node has none.
        nvlink_domain: id of the NVLink domain (a DGX node is its own domain; an NVL72 rack is one).
        leaf: id of the leaf switch the node hangs from.
        excluded: GPU indices that failed the health check and are never handed out.
        cpus: CPU slots, used by CPU-only jobs (``gpus: 0``).
        gpu_memory_gb: memory of one GPU in GiB (0: unknown; shares by memory need it).
        mig_mode: GPUs in MIG mode: never handed out whole, only their slices.
        mig: the MIG slices of those GPUs (as the administrator created them).
        gpu_uuids: the GPUs' UUIDs by index, when known (MPS clients name GPUs by UUID).
    """

    name: str
    gpus: int
    gpu_type: str = ""
    nvlink_domain: str = ""
    leaf: str = "leaf0"
    excluded: frozenset[int] = frozenset()
    cpus: int = 0
    gpu_memory_gb: float = 0.0
    mig_mode: tuple[int, ...] = ()
    mig: tuple[MigSlice, ...] = ()
    gpu_uuids: tuple[str, ...] = ()

    @property
    def healthy_gpus(self) -> list[int]:
        """Indices of the GPUs that pass their health check."""
        return [i for i in range(self.gpus) if i not in self.excluded]

    @property
    def whole_gpus(self) -> list[int]:
        """Indices of the GPUs that may be handed out whole or shared: healthy and not in MIG mode."""
        mig = set(self.mig_mode) | {s.gpu for s in self.mig}
        return [i for i in self.healthy_gpus if i not in mig]

    @property
    def healthy_slices(self) -> list[MigSlice]:
        """The MIG slices of healthy GPUs."""
        return [s for s in self.mig if s.gpu not in self.excluded]


@dataclass(frozen=True)
class PredictedStep:
    """The fabric model's view of a placement (fabric-aware placement only).

    Attributes:
        step_s: predicted training step on this placement.
        consolidated_s: predicted step on the consolidated placement (one node / domain / leaf).
        where: this placement in words, e.g. "3 nodes over 2 leaves".
        consolidated: the consolidated placement in words.
        choice: "consolidated", "spread" (started although slower) or "wait".
    """

    step_s: float
    consolidated_s: float
    where: str
    consolidated: str
    choice: str

    @property
    def slowdown(self) -> float:
        """step_s / consolidated_s."""
        return self.step_s / self.consolidated_s if self.consolidated_s > 0 else 1.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (recorded with the job's placement)."""
        return {
            "step_s": self.step_s,
            "consolidated_step_s": self.consolidated_s,
            "where": self.where,
            "consolidated": self.consolidated,
            "choice": self.choice,
        }


@dataclass(frozen=True)
class GpuShare:
    """A request for part of one GPU, or for MIG slices.

    Attributes:
        fraction: share of one GPU's compute (0-1); None: the memory asked over the GPU's memory.
        memory_gb: GPU memory (GiB); None: ``fraction`` of the GPU's memory.
        mig: a MIG profile (``1g.10gb``): the job gets ``slices`` free slices of it on one node.
        slices: MIG slices asked.
    """

    fraction: float | None = None
    memory_gb: float | None = None
    mig: str | None = None
    slices: int = 1

    def describe(self) -> str:
        """``0.5 GPU``, ``20 GB of a GPU``, ``0.25 GPU, 10 GB``, ``2x MIG 1g.10gb``."""
        if self.mig:
            return f"{self.slices}x MIG {self.mig}" if self.slices > 1 else f"MIG {self.mig}"
        parts = [f"{self.fraction:g} GPU"] if self.fraction is not None else []
        if self.memory_gb is not None:
            parts.append(f"{self.memory_gb:g} GB" + ("" if parts else " of a GPU"))
        return ", ".join(parts)


def share_of(resources: Mapping[str, Any] | None) -> GpuShare | None:
    """The share or MIG request in a spec's ``resources`` (as stored: a dict), None for whole GPUs."""
    res = resources or {}
    if res.get("mig"):
        return GpuShare(mig=str(res["mig"]), slices=int(res.get("slices") or 1))
    fraction, memory = res.get("gpu_fraction"), res.get("gpu_memory_gb")
    if fraction is None and memory is None:
        return None
    return GpuShare(
        fraction=float(fraction) if fraction is not None else None,
        memory_gb=float(memory) if memory is not None else None,
    )


@dataclass(frozen=True)
class SharePart:
    """A placed share or MIG slice.

    Attributes:
        node: node index.
        gpu: GPU index.
        fraction: share of the GPU's compute held (1/7 per compute slice for MIG).
        memory_gb: GPU memory held (0 when unknown).
        mig_uuid: the MIG device's UUID ("" for a share).
        profile: the MIG profile ("" for a share).
    """

    node: int
    gpu: int
    fraction: float
    memory_gb: float
    mig_uuid: str = ""
    profile: str = ""


@dataclass(frozen=True)
class Placement:
    """Where one job runs: (node index, GPU count) pairs, and a short why for logs and dry runs.

    A share or MIG job has no whole GPUs (``nodes`` is empty) and its ``parts`` say what it holds.
    """

    nodes: tuple[tuple[int, int], ...]
    how: str
    cpus: int = 0
    predicted: PredictedStep | None = None  # set by fabric-aware placement
    parts: tuple[SharePart, ...] = ()

    @property
    def gpus(self) -> int:
        """Total GPUs held."""
        return sum(n for _, n in self.nodes)


def uniform_cluster(
    nodes: int, gpus_per_node: int, gpu_type: str = "gpu", nodes_per_leaf: int = 16, nodes_per_domain: int = 1
) -> list[NodeSpec]:
    """Identical nodes: ``nodes_per_leaf`` per leaf switch, NVLink domains of ``nodes_per_domain`` nodes."""
    return [
        NodeSpec(
            name=f"node{i:04d}",
            gpus=gpus_per_node,
            gpu_type=gpu_type,
            nvlink_domain=f"d{i // max(1, nodes_per_domain)}",
            leaf=f"leaf{i // max(1, nodes_per_leaf)}",
        )
        for i in range(nodes)
    ]


def _codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    names = sorted(set(values))
    index = {v: i for i, v in enumerate(names)}
    return np.array([index[v] for v in values], dtype=np.int64), names


@dataclass
class ClusterState:
    """Free GPU and CPU slots of every node (mutable), plus the fixed topology as integer codes.

    ``free`` counts each node's whole GPUs nothing holds (gang placement's view); the shares and MIG
    slices live in the share model (:attr:`shares`, built on first use and copied on write), placed
    by ``packing`` (a name of :data:`gpuyard.scheduler.packing.PACKING_POLICIES`).
    """

    nodes: list[NodeSpec]
    packing: str = DEFAULT_PACKING
    free: np.ndarray = field(init=False)
    free_cpus: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = np.array([len(n.whole_gpus) for n in self.nodes], dtype=np.int64)
        self.gpu_memory = np.array([n.gpu_memory_gb for n in self.nodes], dtype=np.float64)
        self.slices = [n.healthy_slices for n in self.nodes]
        self.share_policy = LivePacking(self.packing)
        self._base: SharedCluster | None = None  # the share model with nothing held
        self._shares: SharedCluster | None = None  # None: nothing held (the base)
        self._owned = False  # whether _shares is this state's own (else copy it before a change)
        self.slice_uuids: list[str] = []  # the share model's slices' UUIDs, by slice number
        self.cpu_capacity = np.array([n.cpus for n in self.nodes], dtype=np.int64)
        self.free = self.capacity.copy()
        self.free_cpus = self.cpu_capacity.copy()
        self.drained = np.zeros(len(self.nodes), dtype=bool)
        self.domain, _ = _codes([n.nvlink_domain or n.name for n in self.nodes])
        self.leaf, _ = _codes([n.leaf for n in self.nodes])
        self.type_code, self.types = _codes([n.gpu_type for n in self.nodes])
        self.domain_size = np.bincount(self.domain)
        self.multi_node_domains = bool((self.domain_size > 1).any())
        self._type_masks = {t: self.type_code == i for i, t in enumerate(self.types)}

    @property
    def total_gpus(self) -> int:
        """Healthy GPUs in the cluster."""
        return int(self.capacity.sum())

    @property
    def free_gpus(self) -> int:
        """GPUs free right now (on nodes that are not drained)."""
        if self.drained.any():
            return int(self.free[~self.drained].sum())
        return int(self.free.sum())

    def set_drained(self, indices: set[int] | frozenset[int]) -> None:
        """Drain exactly the nodes at ``indices`` (node health): nothing new is placed on them."""
        drained = np.zeros(len(self.nodes), dtype=bool)
        drained[sorted(indices)] = True
        self.drained = drained

    def drain_more(self, indices: set[int] | frozenset[int]) -> None:
        """Also drain the nodes at ``indices`` (a new array: copies of this state keep theirs)."""
        self.set_drained(set(np.flatnonzero(self.drained).tolist()) | set(indices))

    def copy(self) -> ClusterState:
        """A copy whose free slots can be changed without touching this one (the topology is shared;
        the share model is copied when either changes it)."""
        other = object.__new__(ClusterState)
        other.__dict__.update(self.__dict__)
        other.free = self.free.copy()
        other.free_cpus = self.free_cpus.copy()
        self._owned = other._owned = False
        return other

    def reset(self) -> None:
        """Everything free again (before holding what the records say is in use)."""
        self.free = self.capacity.copy()
        self.free_cpus = self.cpu_capacity.copy()
        self._shares, self._owned = None, False

    @property
    def shares(self) -> SharedCluster:
        """The share model as it is now (read only: :meth:`_model` to change it)."""
        return self._model(write=False)

    def _model(self, write: bool = True) -> SharedCluster:
        if self._base is None:
            self._base, self.slice_uuids = share_model(self.nodes)
        if self._shares is None:
            if not write:
                return self._base
            self._shares, self._owned = self._base.copy(), True
        elif write and not self._owned:
            self._shares, self._owned = self._shares.copy(), True
        return self._shares

    def pin_whole(self) -> list[tuple[int, tuple[int, ...]]]:
        """Hold in the share model the whole GPUs that ``free`` counts as taken but the model does not
        (whole-GPU starts since): each node's first whole free ones, as a launch gives them. Returns
        what it held, for :meth:`unpin`."""
        return _hide_taken(self, self._model())

    def unpin(self, pinned: list[tuple[int, tuple[int, ...]]]) -> None:
        """Give back to the share model the whole GPUs :meth:`pin_whole` held."""
        if pinned:
            _show_taken(self._model(), pinned)

    def observe(self, shapes: Counter[tuple[Any, ...]]) -> None:
        """The jobs the scheduler knows now, as task shapes (``GpuTask.shape``: the share policy's
        task mix; FGD measures fragmentation against it)."""
        self.share_policy.observe(shapes)

    def hold_record(self, node: int, part: Mapping[str, Any]) -> None:
        """Hold one node's part of a job's placement record (``{"node", "gpus", "cpus"}``, with
        ``share`` or ``mig`` for a share or MIG job; see :func:`record_part`)."""
        gpus = [int(g) for g in part.get("gpus") or []]
        if part.get("mig"):
            for m in part["mig"]:
                self._hold_slice(node, str(m["uuid"]), str(m.get("profile") or ""), hold=True)
        elif part.get("share"):
            share = part["share"]
            for g in gpus:
                self._hold_share(node, g, float(share["fraction"]), float(share.get("memory_gb") or 0.0))
        else:
            self.free[node] -= len(gpus)
            self.free_cpus[node] -= int(part.get("cpus") or 0) if not gpus else 0
            model = self._model()
            held = [g for g in gpus if 0 <= g < model.left.shape[1]]
            if held:  # what runs is held as recorded, even on a GPU retired since (force)
                model.place(GpuTask("held", 0, 0, len(held), MILLI), (node, tuple(held)), force=True)

    def _share_task(self, node: int, fraction: float, memory: float) -> GpuTask:
        """A share as the share model holds it on ``node``: thousandths of the GPU (at least one) and,
        where the node knows its GPUs' memory, MiB of it."""
        mib = round(memory * 1024) if self.gpu_memory[node] > 0 else 0
        return GpuTask("share", 0, 0, 1, max(1, round(fraction * MILLI)), gpu_memory_mib=mib)

    def _hold_share(self, node: int, gpu: int, fraction: float, memory: float) -> None:
        model = self._model()
        if not 0 <= gpu < model.left.shape[1]:
            return  # a record of a GPU this node no longer has: nothing here to hold
        if model.left[node, gpu] == MILLI:
            self.free[node] -= 1  # a whole free GPU becomes a shared one
        model.place(self._share_task(node, fraction, memory), (node, (gpu,)), force=True)

    def _release_share(self, node: int, gpu: int, fraction: float, memory: float) -> None:
        model = self._model()
        model.release(self._share_task(node, fraction, memory), (node, (gpu,)))
        if model.left[node, gpu] == MILLI and not model.shares_on[node, gpu]:
            self.free[node] += 1  # its last share ended: whole again

    def _hold_slice(self, node: int, uuid: str, profile: str, hold: bool) -> None:
        model = self._model()
        try:
            sid = self.slice_uuids.index(uuid)
        except ValueError:
            return  # a slice not in the inventory (gone, or on a failed GPU): nothing to hold
        if bool(model.slice_busy[sid]) == hold or int(model.slice_node[sid]) != node:
            return
        task = GpuTask("slice", 0, 0, 1, 0, mig=model.mig_profiles[int(model.slice_profile[sid])])
        if hold:
            model.place(task, (node, (sid,)))
        else:
            model.release(task, (node, (sid,)))

    @property
    def mig_used(self) -> set[str]:
        """The UUIDs of the MIG slices held."""
        busy = np.flatnonzero(self.shares.slice_busy) if self.slice_uuids else ()
        return {self.slice_uuids[int(s)] for s in busy}

    def gpu_use(self) -> dict[tuple[int, int], tuple[float, float]]:
        """Shared GPUs: (node, gpu) -> (fraction, memory GiB) held by share jobs."""
        if not self.nodes:
            return {}
        m = self.shares
        out = {}
        for n, g in zip(*np.nonzero(m.shares_on > 0), strict=True):
            memory = float(m.gmem_cap[n] - m.gmem_left[n, g]) / 1024 if m.gmem_cap[n] else 0.0
            out[(int(n), int(g))] = ((MILLI - int(m.left[n, g])) / MILLI, memory)
        return out

    def type_mask(self, gpu_type: str | None) -> np.ndarray | None:
        """Boolean mask of the nodes with that GPU type (None: any type)."""
        if not gpu_type:
            return None
        mask = self._type_masks.get(gpu_type)
        return mask if mask is not None else np.zeros(len(self.nodes), dtype=bool)

    def max_gpus(self, gpu_type: str | None = None, multi_node: bool = True) -> int:
        """The most GPUs one job could ever get (empty cluster), by type and by executor reach."""
        cap = self.capacity if gpu_type is None else self.capacity[self.type_mask(gpu_type)]
        if cap.size == 0:
            return 0
        return int(cap.sum() if multi_node else cap.max())

    def take(self, placement: Placement) -> None:
        """Mark a placement's slots as used."""
        for node, n in placement.nodes:
            self.free[node] -= n
            self.free_cpus[node] -= placement.cpus if n == 0 else 0
        for p in placement.parts:
            if p.mig_uuid:
                self._hold_slice(p.node, p.mig_uuid, p.profile, hold=True)
            else:
                self._hold_share(p.node, p.gpu, p.fraction, p.memory_gb)

    def release(self, placement: Placement) -> None:
        """Give a placement's slots back."""
        for node, n in placement.nodes:
            self.free[node] += n
            self.free_cpus[node] += placement.cpus if n == 0 else 0
        for p in placement.parts:
            if p.mig_uuid:
                self._hold_slice(p.node, p.mig_uuid, p.profile, hold=False)
            else:
                self._release_share(p.node, p.gpu, p.fraction, p.memory_gb)


def _fill(free: np.ndarray, idx: np.ndarray, gpus: int) -> list[tuple[int, int]] | None:
    """Fewest nodes among ``idx`` for ``gpus``: the fullest-free nodes first, the remainder best fit."""
    order = idx[np.argsort(-free[idx], kind="stable")]
    chosen: list[tuple[int, int]] = []
    left = gpus
    for pos, node in enumerate(order):
        f = int(free[node])
        if f <= 0 or left <= 0:
            break
        if f >= left:
            # Best fit for the remainder among the nodes not taken yet: keep big holes for big jobs.
            rest = order[pos:]
            fits = rest[free[rest] >= left]
            best = int(fits[np.argmin(free[fits])])
            chosen.append((best, left))
            return chosen
        chosen.append((int(node), f))
        left -= f
    return None


def place(
    state: ClusterState,
    gpus: int,
    gpu_type: str | None = None,
    cpus: int = 1,
    multi_node: bool = True,
    share: GpuShare | None = None,
) -> Placement | None:
    """Choose the GPUs for one job, all or nothing; ``None`` when it cannot start now.

    Args:
        state: the cluster and its free slots (not changed; call ``state.take`` to commit).
        gpus: GPUs the job needs (0: a CPU-only job, placed on CPU slots).
        gpu_type: required GPU type, or None for any.
        cpus: CPU slots for a CPU-only job.
        multi_node: whether the executor can spread one job over several nodes.
        share: part of one GPU or MIG slices instead of whole GPUs (see :func:`place_share`).
    """
    if share is not None:
        return place_share(state, share, gpu_type)
    free = np.where(state.drained, 0, state.free) if state.drained.any() else state.free
    if gpus == 0:
        fits = np.flatnonzero((state.free_cpus >= cpus) & ~state.drained)
        if fits.size == 0:
            return None
        node = int(fits[np.argmin(state.free_cpus[fits])])
        return Placement(((node, 0),), "cpu slots", cpus=cpus)
    mask = state.type_mask(gpu_type)
    avail = free if mask is None else np.where(mask, free, 0)
    # 1. one node, best fit.
    fit = np.where(avail >= gpus, avail, _BIG)
    best = int(fit.argmin())
    if fit[best] != _BIG:
        return Placement(((best, gpus),), "one node, best fit")
    if not multi_node or int(avail.sum()) < gpus:
        return None
    # 2. one multi-node NVLink domain: the fullest domain that still fits.
    if state.multi_node_domains:
        dom_free = np.bincount(state.domain, weights=avail, minlength=len(state.domain_size))
        dom_fit = np.where((dom_free >= gpus) & (state.domain_size > 1), dom_free, np.inf)
        d = int(dom_fit.argmin())
        if np.isfinite(dom_fit[d]):
            chosen = _fill(avail, np.flatnonzero(state.domain == d), gpus)
            if chosen:
                return Placement(tuple(chosen), f"one NVLink domain ({len(chosen)} nodes)")
    # 3. the fewest nodes under one leaf switch.
    leaf_free = np.bincount(state.leaf, weights=avail)
    best_choice: list[tuple[int, int]] | None = None
    for lf in np.flatnonzero(leaf_free >= gpus):
        chosen = _fill(avail, np.flatnonzero((state.leaf == lf) & (avail > 0)), gpus)
        if chosen and (best_choice is None or len(chosen) < len(best_choice)):
            best_choice = chosen
    if best_choice:
        return Placement(tuple(best_choice), f"one leaf switch ({len(best_choice)} nodes)")
    # 4. across leaves, fewest nodes.
    chosen = _fill(avail, np.flatnonzero(avail > 0), gpus)
    if chosen:
        return Placement(tuple(chosen), f"across leaf switches ({len(chosen)} nodes)")
    return None


def fragmentation(state: ClusterState) -> float:
    """Share of free GPUs that sit on partly used nodes (0: every free GPU is on a whole free node)."""
    total = int(state.free.sum())
    if total == 0:
        return 0.0
    whole = int(state.free[state.free == state.capacity].sum())
    return 1.0 - whole / total


# -- shares and MIG slices ------------------------------------------------------------------------


def _share_size(share: GpuShare, gpu_memory: float) -> tuple[float, float] | None:
    """(fraction, memory GiB) a share holds on a GPU of ``gpu_memory`` GiB (0: unknown); None when
    the GPU's memory is needed and unknown."""
    if share.fraction is not None:
        fraction = share.fraction
    elif gpu_memory > 0 and share.memory_gb is not None:
        fraction = share.memory_gb / gpu_memory
    else:
        return None
    memory = share.memory_gb if share.memory_gb is not None else fraction * gpu_memory
    return fraction, memory


def _candidates(state: ClusterState, gpu_type: str | None) -> list[int]:
    mask = state.type_mask(gpu_type)
    ok = ~state.drained if mask is None else (mask & ~state.drained)
    return [int(i) for i in np.flatnonzero(ok)]


def share_model(nodes: Iterable[NodeSpec]) -> tuple[SharedCluster, list[str]]:
    """The share model of ``nodes`` with nothing held, and its MIG slices' UUIDs by slice number.

    GPUs that failed their health check and GPUs in MIG mode without a placeable slice are retired
    (never placed on); MIG compute instances below a GPU instance (``1c.3g.20gb``) are not placed.
    """
    specs, uuids, retire = [], [], []
    for i, n in enumerate(nodes):
        on: dict[int, list[MigSlice]] = {}
        for s in n.healthy_slices:
            if 0 <= s.gpu < n.gpus and s.profile in PROFILE_NAMES:
                on.setdefault(s.gpu, []).append(s)
        layout = tuple(tuple((s.profile, k) for k, s in enumerate(on.get(g, []))) for g in range(n.gpus))
        uuids += [s.uuid for g in range(n.gpus) for s in on.get(g, [])]
        mig = set(n.mig_mode) | {s.gpu for s in n.mig}
        retire += [(i, g) for g in range(n.gpus) if (g in n.excluded or g in mig) and g not in on]
        memory = int(n.gpu_memory_gb * 1024 + _MEM_EPS * 1024) if n.gpu_memory_gb > 0 else 0
        mig_layout = layout if on else ()
        specs.append(GpuNode(n.name, max(n.cpus, 1) * 1000, 0, n.gpus, n.gpu_type, mig_layout, memory))
    model = SharedCluster(specs)
    for node, gpu in retire:
        model.retire(node, gpu)
    return model, uuids


def place_share(state: ClusterState, share: GpuShare, gpu_type: str | None = None) -> Placement | None:
    """Place part of one GPU, or MIG slices; ``None`` when it cannot start now.

    The state's packing policy (:class:`gpuyard.scheduler.packing.LivePacking`, FGD by default)
    chooses on the share model, among the nodes of ``gpu_type`` that are not drained: a share goes to
    a GPU with room for its compute (thousandths, at least one) and memory (where the node knows its
    GPUs' memory), a shared one or a whole free one; MIG slices: ``slices`` free slices of the
    profile on one node. The whole GPUs that this decision's whole-GPU starts took (counted in
    ``free``, not yet in the model) are kept out: the first free ones, as the launch gives them.
    """
    if not state.nodes:
        return None
    mask = state.type_mask(gpu_type)
    allowed = ~state.drained if mask is None else (mask & ~state.drained)
    model = state._model()
    hidden = _hide_taken(state, model)
    try:
        if share.mig:
            task = GpuTask(share.describe(), 0, 0, share.slices, 0, mig=share.mig)
            choice = _choose(state, model, task, allowed)
            if choice is None:
                return None
            node, ids = choice
            size = int(share.mig.split("g.")[0]) / 7
            memory = float(share.mig.split(".")[1].removesuffix("gb"))
            parts = tuple(
                SharePart(node, int(model.slice_gpu[s]), size, memory, state.slice_uuids[s], share.mig)
                for s in ids
            )
            where = ", ".join(f"GPU {g}" for g in sorted({p.gpu for p in parts}))
            return Placement((), f"{share.describe()} on {where}", parts=parts)
        # Nodes alike in GPU memory size a share alike: one choice per size, the largest first.
        for size in sorted({float(state.gpu_memory[n]) for n in np.flatnonzero(allowed)}, reverse=True):
            sized = _share_size(share, size)
            if sized is None or sized[0] > 1 + _EPS or (size > 0 and sized[1] > size + _MEM_EPS):
                continue
            fraction, memory = sized
            group = allowed & (state.gpu_memory == size)
            task = state._share_task(int(np.flatnonzero(group)[0]), fraction, memory)
            choice = _choose(state, model, task, group)
            if choice is not None:
                node, (gpu,) = choice
                how = f"shares GPU {gpu}" if model.shares_on[node, gpu] else f"a free GPU ({gpu}), shared"
                return Placement(
                    (), f"{share.describe()}: {how}", parts=(SharePart(node, gpu, fraction, memory),)
                )
        return None
    finally:
        _show_taken(model, hidden)


def _choose(
    state: ClusterState, model: SharedCluster, task: GpuTask, allowed: np.ndarray
) -> tuple[int, tuple[int, ...]] | None:
    """The packing policy's choice for ``task`` among the ``allowed`` nodes."""
    model.blocked = ~allowed
    try:
        return state.share_policy.choose(model, task)
    finally:
        model.blocked = np.zeros(len(state.nodes), dtype=np.bool_)


def _hide_taken(state: ClusterState, model: SharedCluster) -> list[tuple[int, tuple[int, ...]]]:
    """Hold in the model the whole GPUs that ``state.free`` counts as taken but the model does not
    (whole-GPU starts of this decision): each node's first whole free ones. Returns what it held."""
    whole = (model.left == MILLI) & (model.shares_on == 0)
    taken = whole.sum(axis=1) - state.free
    hidden = []
    for node in np.flatnonzero(taken > 0):
        gpus = tuple(int(g) for g in np.flatnonzero(whole[node])[: int(taken[node])])
        model.place(GpuTask("taken", 0, 0, len(gpus), MILLI), (int(node), gpus))
        hidden.append((int(node), gpus))
    return hidden


def _show_taken(model: SharedCluster, hidden: list[tuple[int, tuple[int, ...]]]) -> None:
    """Give back what :func:`_hide_taken` held."""
    for node, gpus in hidden:
        model.release(GpuTask("taken", 0, 0, len(gpus), MILLI), (node, gpus))


def share_never_fits(state: ClusterState, share: GpuShare, gpu_type: str | None = None) -> str | None:
    """Why a share or MIG request could never start on this cluster (one line), or None when it could."""
    mask = state.type_mask(gpu_type)
    nodes = [i for i in range(len(state.nodes)) if mask is None or mask[i]]
    if share.mig:
        offered: dict[str, int] = {}
        for n in nodes:
            for s in state.slices[n]:
                offered[s.profile] = offered.get(s.profile, 0) + 1
        most = max((sum(s.profile == share.mig for s in state.slices[n]) for n in nodes), default=0)
        if most >= share.slices:
            return None
        have = ", ".join(f"{p} x{c}" for p, c in sorted(offered.items())) or "none"
        if not most:
            return f"resources.mig: no GPU here has a {share.mig} slice; MIG slices here: {have}"
        return (
            f"resources.slices: {share.slices} {share.mig} slices asked, a node here has at most {most}: "
            "it could never start"
        )
    whole = [n for n in nodes if state.capacity[n] > 0]
    if not whole:
        return (
            "resources: no GPU here can be shared (each is in MIG mode or unhealthy, or none is of gpu_type)"
        )
    if share.fraction is None and not any(state.gpu_memory[n] > 0 for n in whole):
        return "resources.gpu_memory_gb: the GPUs here do not report their memory; ask for a fraction instead"
    if share.memory_gb is not None:
        known = [float(state.gpu_memory[n]) for n in whole if state.gpu_memory[n] > 0]
        if known and share.memory_gb > max(known) + _MEM_EPS:
            return (
                f"resources.gpu_memory_gb: {share.memory_gb:g} GB asked, the largest GPU here has "
                f"{max(known):.1f} GB: it could never start"
            )
    return None


def record_part(node: str, gpus: tuple[int, ...], cpus: int, parts: list[SharePart]) -> dict[str, Any]:
    """The placement record of one node of a job (``JobRow.placement["nodes"]`` items): its GPUs and
    CPU slots, and for a share ``share: {fraction, memory_gb}``, for MIG ``mig: [{gpu, profile, uuid}]``."""
    doc: dict[str, Any] = {"node": node, "gpus": list(gpus), "cpus": cpus}
    mig = [p for p in parts if p.mig_uuid]
    if mig:
        doc["mig"] = [{"gpu": p.gpu, "profile": p.profile, "uuid": p.mig_uuid} for p in mig]
    elif parts:
        doc["share"] = {"fraction": round(parts[0].fraction, 6), "memory_gb": round(parts[0].memory_gb, 3)}
    return doc


def why_waiting(
    state: ClusterState,
    gpus: int,
    gpu_type: str | None = None,
    share: GpuShare | None = None,
    cpus: int = 1,
    multi_node: bool = True,
) -> str:
    """Why a job that did not start waits, in one line, on ``state`` (after this decision's starts)."""
    mask = state.type_mask(gpu_type)
    nodes = [i for i in range(len(state.nodes)) if (mask is None or mask[i]) and not state.drained[i]]
    of = f" {gpu_type}" if gpu_type else ""
    drained = f"; {int(state.drained.sum())} node(s) drained" if state.drained.any() else ""
    if place(state, gpus, gpu_type, cpus, multi_node, share) is not None:  # place() changes nothing
        return f"waiting for its turn: it fits now, but jobs before it in policy order go first{drained}"
    if share is not None and share.mig:
        slices = [s for n in nodes for s in state.slices[n] if s.profile == share.mig]
        free = sum(s.uuid not in state.mig_used for s in slices)
        return f"waiting for {share.describe()}: {free} of {len(slices)} such slices free{drained}"
    free = sum(int(state.free[n]) for n in nodes)
    if share is not None:
        busy = sorted((f, n, g) for (n, g), (f, _) in state.gpu_use().items() if n in nodes)
        used = ", ".join(f"{state.nodes[n].name}:{g} {f:.2g}/1.0 held" for f, n, g in busy[-4:])
        return (
            f"waiting for {share.describe()}: no shared GPU has room ({used or 'none shared'}) and "
            f"{free} whole{of} GPUs free{drained}"
        )
    if gpus == 0:
        return f"waiting for {cpus} CPU slot(s): none free on one node{drained}"
    shared = len({k for k in state.gpu_use() if k[0] in nodes})
    mig = sum(len(set(state.nodes[n].mig_mode) | {s.gpu for s in state.nodes[n].mig}) for n in nodes)
    notes = [f"{shared} shared"] if shared else []
    notes += [f"{mig} in MIG mode"] if mig else []
    extra = f" ({', '.join(notes)})" if notes else ""
    where = "" if multi_node else " on one node"
    return f"waiting for {gpus}{of} GPU{'s' if gpus > 1 else ''}{where}: {free} whole free{extra}{drained}"
