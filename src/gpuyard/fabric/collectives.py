"""Collective cost model: time, algbw and busbw of NCCL-style collectives on a cluster.

The model follows NCCL's own tuner (``src/graph/tuning.cc``): every (algorithm, protocol) pair costs
``base latency + steps x hop latency + bytes on the wire / bandwidth``, and the cheapest pair wins.

* Algorithms: ``ring`` (any op), ``tree`` (all_reduce across nodes: a chain inside the node, a double
  binary tree between nodes), ``hierarchical`` (reduce-scatter inside the NVLink domain, all-reduce
  of 1/k of the data across domains, all-gather back), ``nvls`` (NVSwitch in-network reduction on
  NVSwitch gen 3+, one domain), ``direct`` (all_to_all and send/recv: every peer at once).
* Protocols: ``LL`` (8-byte lines carrying 4 data bytes plus a flag, so low latency at a third of
  the bandwidth, as NCCL's tuner assumes for one node) and ``Simple`` (full bandwidth, 4x the hop
  latency, and ``SIMPLE_RAMP_BYTES`` in flight across channels before a ring streams at full rate).
  LL128 sits between the two on every published curve and is folded into them.

Bus bandwidth uses nccl-tests' definitions (``doc/PERFORMANCE.md``): algbw = size / time;
busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all,
x 1 for broadcast and send/recv.

Calibration (A100 NVLink3 + NVSwitch, preset ``dgx-a100``): nccl-tests all_reduce_perf on 8x A100
SXM4 reports busbw of about 18-36 GB/s at 1 MiB, 167-172 GB/s at 64 MiB and 228-229 GB/s at 1 GiB
(stas00/ml-engineering, network/benchmarks; Azure/AI-benchmarking-guide, ND A100 v4 results). With
the preset's 2.7 us hop latency and 78% of 300 GB/s, this model gives 27, 170 and 229 GB/s.
NVLS (``dgx-h100``): 8x H100 SXM5 all_reduce reaches 460-480 GB/s busbw at large sizes (Alaya NeW,
"NCCL-tests in practice", reference table); 61% of 450 GB/s gives 474 GB/s at 1 GiB.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree", "hierarchical", "nvls", "direct")

# Bytes in flight across all channels before a Simple-protocol ring streams at full rate; fitted to
# the 64 MiB point of the published A100 curve (the 1 GiB point fixes the bandwidth).
SIMPLE_RAMP_BYTES = 6.8e6
# NCCL's tuner scales tree bandwidth down against ring (treeCorrectionFactor); 0.9 is its mid value.
TREE_EFFICIENCY = 0.9
# Per-peer launch cost of a direct all_to_all (one send and one receive posted per peer).
PEER_OVERHEAD_S = 0.4e-6


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: fixed latency, hop-latency multiplier, share of link bandwidth, ramp bytes."""

    name: str
    base_s: float
    hop_mult: float
    bw_frac: float
    ramp_bytes: float


# Base latencies are NCCL's tuner values for ring (6.6 us LL, 8.4 us Simple); the hop multiplier
# keeps NCCL's ratio between Simple and LL hop latency on NVLink (about 4x).
PROTOCOLS = (Protocol("LL", 6.6e-6, 1.0, 1 / 3, 0.0), Protocol("Simple", 8.4e-6, 4.0, 1.0, SIMPLE_RAMP_BYTES))
# Clusters calibrated by `gpuyard fabric bench` (gloo and the like): one hop latency, one bandwidth.
ALPHA_BETA = (Protocol("alpha-beta", 0.0, 1.0, 1.0, 0.0),)


@dataclass(frozen=True)
class Links:
    """Link figures a collective group sees: hop latencies (s) and bandwidths (bytes/s per rank)."""

    alpha_intra: float
    bw_intra: float
    alpha_net: float
    bw_net: float
    bw_nvls: float
    protocols: tuple[Protocol, ...] = PROTOCOLS


@dataclass(frozen=True)
class Placement:
    """How a group of ``gpus`` ranks sits on the cluster: ``per_domain`` ranks in each of ``domains``."""

    gpus: int
    per_domain: int
    domains: int


@dataclass(frozen=True)
class CollectiveEstimate:
    """The modelled cost of one collective."""

    op: str
    gpus: int
    size_bytes: int
    algorithm: str
    protocol: str
    time_s: float
    algbw_GBps: float
    busbw_GBps: float

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form."""
        return asdict(self)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``op`` on ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def place(cluster: Cluster, gpus: int, per_domain: int | None = None) -> Placement:
    """Spread ``gpus`` ranks over as few NVLink domains as possible (or ``per_domain`` per domain)."""
    k = min(gpus, cluster.domain) if per_domain is None else max(1, min(per_domain, gpus))
    return Placement(gpus=gpus, per_domain=k, domains=max(1, math.ceil(gpus / k)))


def links(cluster: Cluster, p: Placement) -> Links:
    """Link figures for a group placed as ``p``, when every GPU of the domain runs the same collective.

    The domain's NICs are shared by the groups that run at once in it, so a group with ``per_domain``
    ranks gets ``per_domain / domain`` of them (all of them for an nccl-tests run over whole nodes).
    """
    intra, nic, net = cluster.intra, cluster.nic, cluster.network
    nodes_per_domain = max(1, cluster.domain // cluster.gpus_per_node)
    nic_bytes = cluster.nic_GBps_per_node * 1e9 * nodes_per_domain * nic.bw_efficiency
    if not nic.gpudirect_rdma:
        nic_bytes *= 0.8  # a bounce through host memory costs a PCIe crossing
    alpha_net = nic.latency_us * 1e-6 + (0.0 if nic.gpudirect_rdma else 2e-6)
    crosses_spine = p.domains * nodes_per_domain > net.leaf_size
    if p.domains > 1 and (crosses_spine or not net.rail_optimized):
        # Off the leaf (or off the rail), a message climbs to the spine and back down.
        alpha_net += 2 * net.spine_latency_us * 1e-6
        if crosses_spine:
            nic_bytes /= net.oversubscription
        if net.spine_size is not None and p.domains * nodes_per_domain > net.spine_size:
            # Beyond one spine group (a three-tier Clos): two more switch hops and the core's ratio.
            alpha_net += 2 * net.spine_latency_us * 1e-6
            nic_bytes /= net.core_oversubscription
    share = min(1.0, p.per_domain / cluster.domain)
    return Links(
        alpha_intra=intra.latency_us * 1e-6,
        bw_intra=intra.bw_GBps * 1e9 * intra.bw_efficiency,
        alpha_net=alpha_net,
        bw_net=max(nic_bytes * share, 1.0),
        bw_nvls=intra.bw_GBps * 1e9 * intra.nvls_efficiency if intra.nvls else 0.0,
        protocols=ALPHA_BETA if cluster.collective_model == "alpha-beta" else PROTOCOLS,
    )


def _best(
    steps: float, hop: float, wire: float, bw: float, protocols: tuple[Protocol, ...], eff: float = 1.0
) -> tuple[float, str]:
    """Cheapest protocol for a pipeline of ``steps`` hops moving ``wire`` bytes per rank."""
    best = (math.inf, "")
    for pr in protocols:
        t = pr.base_s + steps * hop * pr.hop_mult + (wire + pr.ramp_bytes) / (bw * pr.bw_frac * eff)
        best = min(best, (t, pr.name))
    return best


def _ring_link(p: Placement, lk: Links) -> tuple[float, float]:
    """(hop latency, bandwidth) of a ring over the placement: the slowest link bounds it."""
    if p.domains == 1:
        return lk.alpha_intra, lk.bw_intra
    if p.per_domain == 1:
        return lk.alpha_net, lk.bw_net
    k = p.per_domain
    return ((k - 1) * lk.alpha_intra + lk.alpha_net) / k, min(lk.bw_intra, lk.bw_net)


def _candidates(op: str, size: float, p: Placement, lk: Links) -> list[tuple[float, str, str]]:
    n, k, m = p.gpus, p.per_domain, p.domains
    hop, bw = _ring_link(p, lk)
    out: list[tuple[float, str, str]] = []
    if op == "all_reduce":
        out.append((*_best(2 * (n - 1), hop, 2 * (n - 1) / n * size, bw, lk.protocols), "ring"))
        if m == 1 and lk.bw_nvls > 0 and n > 2:
            out.append((*_best(2, lk.alpha_intra, size, lk.bw_nvls, lk.protocols), "nvls"))
        if m > 1:
            depth = (k - 1) * lk.alpha_intra + math.ceil(math.log2(m)) * lk.alpha_net
            out.append(
                (*_best(2, depth, 2 * size, min(bw, lk.bw_net), lk.protocols, TREE_EFFICIENCY), "tree")
            )
        if m > 1 and k > 1:
            inner = Placement(k, k, 1)
            outer = Placement(m, 1, m)
            outer_links = Links(lk.alpha_intra, lk.bw_intra, lk.alpha_net, lk.bw_net / k, 0.0, lk.protocols)
            t = (
                _time("reduce_scatter", size, inner, lk)[0]
                + _time("all_reduce", size / k, outer, outer_links)[0]
                + _time("all_gather", size, inner, lk)[0]
            )
            out.append((t, "Simple", "hierarchical"))
    elif op in ("all_gather", "reduce_scatter"):
        out.append((*_best(n - 1, hop, (n - 1) / n * size, bw, lk.protocols), "ring"))
    elif op == "broadcast":
        out.append((*_best(n - 1, hop, size, bw, lk.protocols), "ring"))
    elif op == "all_to_all":
        intra_t = (k - 1) / n * size / lk.bw_intra if k > 1 else 0.0
        net_t = (n - k) / n * size / (lk.bw_net / k) if m > 1 else 0.0
        alpha = lk.alpha_net if m > 1 else lk.alpha_intra
        simple = lk.protocols[-1]
        t = simple.base_s + alpha + (n - 1) * PEER_OVERHEAD_S + max(intra_t, net_t) + simple.ramp_bytes / bw
        out.append((t, "Simple", "direct"))
    elif op == "send_recv":
        alpha, link_bw = (lk.alpha_intra, lk.bw_intra) if m == 1 else (lk.alpha_net, lk.bw_net / k)
        out.append((*_best(1, alpha, size, link_bw, lk.protocols), "direct"))
    return out


def _time(
    op: str, size: float, p: Placement, lk: Links, algorithm: str | None = None
) -> tuple[float, str, str]:
    if p.gpus <= 1:
        return 0.0, "none", "local"
    cands = _candidates(op, size, p, lk)
    if algorithm is not None:
        cands = [c for c in cands if c[2] == algorithm]
        if not cands:
            raise ConfigError(f"algorithm {algorithm!r} does not apply to {op} on {p.gpus} GPUs here")
    return min(cands)


@lru_cache(maxsize=1 << 16)
def collective_time(
    cluster: Cluster, op: str, size_bytes: float, gpus: int, per_domain: int | None = None
) -> float:
    """Seconds for one collective of ``size_bytes`` over ``gpus`` ranks (the planner's entry point).

    Args:
        cluster: the cluster.
        op: one of :data:`OPS`.
        size_bytes: nccl-tests' size (the full buffer: output of all_gather, input of reduce_scatter).
        gpus: ranks in the group.
        per_domain: ranks of the group inside one NVLink domain (default: as packed as possible).

    Memoised: the planner asks for the same few collectives across thousands of layouts.
    """
    p = place(cluster, gpus, per_domain)
    return _time(op, size_bytes, p, links(cluster, p))[0]


def estimate(
    cluster: Cluster, op: str, gpus: int, size_bytes: int, algorithm: str | None = None
) -> CollectiveEstimate:
    """Model one collective the way nccl-tests would report it.

    Args:
        cluster: the cluster (GPUs are packed into whole nodes, as many as needed).
        op: one of :data:`OPS`.
        gpus: ranks taking part.
        size_bytes: message size in nccl-tests' convention.
        algorithm: force one algorithm instead of picking the fastest.

    Raises:
        ConfigError: unknown op or algorithm, a size below 1 byte, GPUs that cannot be placed.
        CapacityError: more GPUs than the cluster has.
    """
    if op not in OPS:
        raise ConfigError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if size_bytes < 1:
        raise ConfigError(f"size must be at least 1 byte, got {size_bytes}")
    cluster.check_gpus(gpus)
    p = place(cluster, gpus)
    t, proto, algo = _time(op, float(size_bytes), p, links(cluster, p), algorithm)
    algbw = size_bytes / t / 1e9 if t > 0 else 0.0
    busbw = algbw * bus_factor(op, gpus)
    return CollectiveEstimate(op, gpus, size_bytes, algo, proto, t, algbw_GBps=algbw, busbw_GBps=busbw)
