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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_BIG = np.iinfo(np.int64).max


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
    """

    name: str
    gpus: int
    gpu_type: str = ""
    nvlink_domain: str = ""
    leaf: str = "leaf0"
    excluded: frozenset[int] = frozenset()
    cpus: int = 0

    @property
    def healthy_gpus(self) -> list[int]:
        """Indices of the GPUs that may be handed out."""
        return [i for i in range(self.gpus) if i not in self.excluded]


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
class Placement:
    """Where one job runs: (node index, GPU count) pairs, and a short why for logs and dry runs."""

    nodes: tuple[tuple[int, int], ...]
    how: str
    cpus: int = 0
    predicted: PredictedStep | None = None  # set by fabric-aware placement

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
    """Free GPU and CPU slots of every node (mutable), plus the fixed topology as integer codes."""

    nodes: list[NodeSpec]
    free: np.ndarray = field(init=False)
    free_cpus: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = np.array([len(n.healthy_gpus) for n in self.nodes], dtype=np.int64)
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

    def copy(self) -> ClusterState:
        """A copy whose free slots can be changed without touching this one (the topology is shared)."""
        other = object.__new__(ClusterState)
        other.__dict__.update(self.__dict__)
        other.free = self.free.copy()
        other.free_cpus = self.free_cpus.copy()
        return other

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

    def release(self, placement: Placement) -> None:
        """Give a placement's slots back."""
        for node, n in placement.nodes:
            self.free[node] += n
            self.free_cpus[node] += placement.cpus if n == 0 else 0


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
    state: ClusterState, gpus: int, gpu_type: str | None = None, cpus: int = 1, multi_node: bool = True
) -> Placement | None:
    """Choose the GPUs for one job, all or nothing; ``None`` when it cannot start now.

    Args:
        state: the cluster and its free slots (not changed; call ``state.take`` to commit).
        gpus: GPUs the job needs (0: a CPU-only job, placed on CPU slots).
        gpu_type: required GPU type, or None for any.
        cpus: CPU slots for a CPU-only job.
        multi_node: whether the executor can spread one job over several nodes.
    """
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
