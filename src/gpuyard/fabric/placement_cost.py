"""Step time of a training job on a concrete placement: how its GPUs sit in NVLink domains and leaf switches.

The step model (:mod:`gpuyard.fabric.step`) assumes a job packed into whole NVLink domains under one
leaf. A scheduler hands out whatever is free: 4 GPUs on each of two servers, or whole servers under two
leaf switches. This module costs such a placement by describing it to the step model as a cluster of
its own (:func:`effective_cluster`):

* the job's GPUs in each NVLink domain it touches are counted; their greatest common divisor ``k`` is
  the largest group that every domain holds whole, so the placement behaves as domains of ``k`` GPUs
  (tensor-parallel groups wider than ``k`` would straddle the network);
* each such domain gets the NIC bandwidth of its ``k`` GPUs (a job on half a server uses half of its
  rails);
* when the GPUs span more than one leaf switch, every group that leaves a domain is costed as
  crossing the spine, with the cluster's oversubscription and spine latency.

Pure functions of plain data (the scheduler only consumes them). Costs are memoised: a scheduler asks
for the same few shapes over and over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache, reduce

from gpuyard.errors import CapacityError, ConfigError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.models import ModelSpec
from gpuyard.fabric.planner import Knobs, plan
from gpuyard.fabric.step import ParallelConfig, estimate_step

# A leaf switch wider than any cluster: a group placed under one leaf never crosses the spine.
_ONE_LEAF = 1 << 30


@dataclass(frozen=True)
class Workload:
    """What a job trains, enough for the step model.

    Attributes:
        model: the transformer.
        global_batch: sequences per step.
        seq_len: tokens per sequence.
        knobs: layout knobs held fixed (all of them: one layout); the rest are searched per placement,
            as `gpuyard plan` does.
    """

    model: ModelSpec
    global_batch: int
    seq_len: int
    knobs: Knobs = field(default_factory=Knobs)


@dataclass(frozen=True)
class PlacementShape:
    """How a job's GPUs sit on the cluster.

    Attributes:
        domain_gpus: the job's GPUs in each NVLink domain it uses, largest first.
        leaves: leaf switches the job's nodes hang from.
        nodes: nodes it uses.
    """

    domain_gpus: tuple[int, ...]
    leaves: int = 1
    nodes: int = 1

    @property
    def gpus(self) -> int:
        """GPUs of the job."""
        return sum(self.domain_gpus)

    @property
    def aligned(self) -> int:
        """GPUs per domain that every domain holds whole (the effective NVLink domain size)."""
        return reduce(math.gcd, self.domain_gpus)

    def describe(self) -> str:
        """Short text, e.g. ``one node``, ``2 nodes, one leaf``, ``3 nodes over 2 leaves``."""
        if self.nodes == 1:
            return "one node"
        if len(self.domain_gpus) == 1:
            return f"{self.nodes} nodes in one NVLink domain"
        if self.leaves == 1:
            return f"{self.nodes} nodes, one leaf"
        return f"{self.nodes} nodes over {self.leaves} leaves"


@dataclass(frozen=True)
class PlacementCost:
    """The predicted step of a workload on one placement shape."""

    shape: PlacementShape
    step_time_s: float
    layout: ParallelConfig

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form: where, how fast, with which layout."""
        c = self.layout
        return {
            "where": self.shape.describe(),
            "step_time_s": self.step_time_s,
            "layout": {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "zero": c.zero},
        }


def effective_cluster(cluster: Cluster, shape: PlacementShape) -> Cluster:
    """The cluster as a job on ``shape`` sees it: domains of ``shape.aligned`` GPUs, spine if over leaves.

    Args:
        cluster: the real cluster (accelerator, fabric, network).
        shape: where the job's GPUs are.
    """
    k = shape.aligned
    # NICs belong to GPUs (one rail each on DGX-class nodes): k GPUs of a domain use k GPUs' share.
    nic_share = k / cluster.gpus_per_node
    nic = cluster.nic.model_copy(update={"gbps": cluster.nic.gbps * nic_share})
    net = cluster.network.model_copy(
        update={"leaf_size": 1 if shape.leaves > 1 else _ONE_LEAF, "spine_size": None}
    )
    intra = cluster.intra.model_copy(update={"domain_size": None})
    return cluster.model_copy(
        update={"gpus_per_node": k, "nodes": None, "nic": nic, "network": net, "intra": intra}
    )


def placement_cost(cluster: Cluster, workload: Workload, shape: PlacementShape) -> PlacementCost:
    """Predict the training step of ``workload`` on GPUs placed as ``shape``.

    With every layout knob held, that layout is costed; otherwise the planner picks the fastest layout
    that fits on this placement (what gpuyard would hand the job there).

    Raises:
        ConfigError: the knobs do not apply to this GPU count or model.
        CapacityError: no layout fits in device memory.
    """
    return _cost(cluster, workload, shape.aligned, len(shape.domain_gpus), shape.leaves > 1, shape)


def _cost(
    cluster: Cluster, workload: Workload, k: int, domains: int, spine: bool, shape: PlacementShape
) -> PlacementCost:
    step, layout = _cost_cached(cluster, workload, k, domains, spine)
    return PlacementCost(shape, step, layout)


@lru_cache(maxsize=4096)
def _cost_cached(
    cluster: Cluster, workload: Workload, k: int, domains: int, spine: bool
) -> tuple[float, ParallelConfig]:
    # Only (k, GPUs, spine) matter to the model, so shapes that share them share one search.
    shape = PlacementShape((k,) * domains, leaves=2 if spine else 1, nodes=domains)
    eff = effective_cluster(cluster, shape)
    gpus = k * domains
    knobs = workload.knobs
    if knobs.fixed():
        fixed = (knobs.tp or 1) * (knobs.pp or 1) * (knobs.cp or 1)
        if gpus % fixed:
            raise ConfigError(f"{gpus} GPUs are not divisible by tp x pp x cp = {fixed}")
        cfg = ParallelConfig(dp=gpus // fixed, **{**vars(knobs), "ep": knobs.ep or 1})
        est = estimate_step(workload.model, eff, gpus, workload.global_batch, workload.seq_len, cfg)
        if not est.fits:
            raise CapacityError(
                f"layout {cfg} needs {est.memory_gib_per_gpu:.1f} GiB per GPU; "
                f"{cluster.device_name} has {cluster.device_memory_bytes / 2**30:.1f} GiB"
            )
        return est.step_time_s, cfg
    result = plan(workload.model, eff, gpus, workload.global_batch, workload.seq_len, knobs, top=1)
    best = result.plans[0]
    return best.step_time_s, best.config


def packed_shape(cluster: Cluster, gpus: int) -> PlacementShape:
    """The consolidated shape of ``gpus`` GPUs: whole NVLink domains, the remainder in one more, one leaf."""
    full, rest = divmod(gpus, cluster.domain)
    counts = (cluster.domain,) * full + ((rest,) if rest else ())
    nodes = max(1, math.ceil(gpus / cluster.gpus_per_node))
    return PlacementShape(counts, leaves=1, nodes=nodes)
