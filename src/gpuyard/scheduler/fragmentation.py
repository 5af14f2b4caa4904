"""Fragmentation of GPU shares, after FGD (Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23), measured against the
workload's mix of task shapes M, each with popularity p_m:

* for one task shape m, the fragment of node n is the GPU capacity left on n that m cannot use:
  all of it when m cannot run on n at all (CPU, memory, GPU model, or too few GPUs with room),
  else the capacity left on the GPUs with less room than m's per-GPU demand;
* the node's fragmentation is the expected fragment F_n = sum_m p_m frag_n(m).

MIG tasks are left out of the mix: F measures the room for shares and whole GPUs, which they never use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.scheduler.gpushares import FloatArray, IntArray, SharedCluster
from gpuyard.scheduler.openb import GpuTask

TYPICAL_POPULARITY = 0.95  # the FGD artifact's experiments: shapes covering 95% of the tasks


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
