"""Collective cost model: time, algbw and busbw of NCCL collectives on a cluster, chosen as NCCL's tuner does.

Every (algorithm, protocol) pair gets NCCL's own cost, ``latency + bytes / bandwidth``
(``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``), and the cheapest pair
wins, as in ``topoGetAlgoInfo`` (``src/enqueue.cc``):

* **Latency** is NCCL's base latency per (algorithm, protocol) plus per-hop latencies by link type
  (NVLink, PCI, network), counted the way ``ncclTopoTuneModel`` counts them for each algorithm.
* **Bandwidth** starts from the cluster's link figures (per-GPU NVLink bandwidth times the share NCCL
  rings reach; the node's NICs) instead of NCCL's topology search, then applies NCCL's refinements:
  LL at 50% capped by ``llMaxBws``, LL128 at 92% capped by channels x ``perChMaxRingLL128Bws``, tree at
  92% capped by channels x ``perChMaxTreeBws`` (LL / 3.8, LL128 x 120/128 or 7/9), PAT at 75%, and
  ``treeCorrectionFactor`` for medium tree messages.
* **Algorithms**: ``ring`` (every op), ``tree`` (all_reduce), ``nvls`` (NVSwitch gen 3+ in-network
  reduction inside one NVLink domain: all_reduce, all_gather, reduce_scatter), ``nvls_tree`` (NVLS
  inside the domain and a tree between domains, all_reduce), ``pat`` (NCCL 2.23+, all_gather and
  reduce_scatter with one rank per node), ``direct`` (all_to_all, send/recv) and ``hierarchical``
  (reduce-scatter / all-reduce / all-gather; gpuyard's, never chosen automatically, only when forced).
  CollNet is left out: it needs SHARP-capable switches and ``NCCL_COLLNET_ENABLE``, which no preset has.

Measured times are NCCL's plus a fixed ``LAUNCH_US`` (kernel launch, nccl-tests' timing), fitted once
across the published corpus (``fabric/published/collectives.yaml``, ``benchmarks/collective_accuracy.py``).

Bus bandwidth uses nccl-tests' definitions (``doc/PERFORMANCE.md``): algbw = size / time;
busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all,
x 1 for broadcast and send/recv.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster
from gpuyard.fabric.torus import torus_time

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "pat", "hierarchical", "direct")
PROTOCOLS = ("LL", "LL128", "Simple")
LL, LL128, SIMPLE = 0, 1, 2

# --- NCCL's tuner constants: src/graph/tuning.cc (NVIDIA/nccl master, 5067397c), ncclTunerConstantsDefaults.
# baseLatencies (us), per algorithm, (LL, LL128, Simple). NVLS and NVLS tree have none.
BASE_LAT_US = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
    "pat": (8.0, 8.0, 8.0),
}
# hwLatencies (us) per hop, by link type (NVLINK, PCI, NET), per algorithm, (LL, LL128, Simple).
HW_LAT_US = {
    "nvlink": {
        "tree": (0.6, 1.25, 4.0),
        "ring": (0.6, 1.9, 3.4),
        "nvls": (0.0, 0.0, 25.0),
        "nvls_tree": (0.0, 0.0, 25.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "pci": {
        "tree": (1.0, 1.9, 4.0),
        "ring": (1.0, 2.5, 5.7),
        "nvls": (0.0, 0.0, 0.0),
        "nvls_tree": (0.0, 0.0, 0.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "net": {
        "tree": (5.0, 8.5, 14.0),
        "ring": (2.7, 4.0, 14.0),
        "nvls": (0.0, 0.0, 18.0),
        "nvls_tree": (0.0, 0.0, 20.9),
        "pat": (0.0, 0.0, 14.0),
    },
}
# Per GPU generation (Ampere, Hopper, Blackwell) and node count bucket (1, 2, 4+ nodes), GB/s.
# llMaxBws: one node looks at the GPU; several nodes at the CPU, and the Intel row (39, 39, 20.4) is
# used here because presets do not name the host CPU.
LL_MAX_BW_ONE_NODE = {"ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_BW_NET = (39.0, 39.0, 20.4)
PER_CH_RING_LL128_BW = {"ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}  # perChMaxRingLL128Bws
PER_CH_TREE_LL128_BW = {  # perChMaxTreeLL128Bws
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0),
    "blackwell": (55.6, 31.67, 20.0),
}
PER_CH_TREE_BW = {  # perChMaxTreeBws
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0),
    "blackwell": (70.0, 42.8, 24.0),
}
PER_CH_NVLS_TREE_BW = {  # perChMaxNVLSTreeBws
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (0.0, 57.7, 45.5),
    "blackwell": (0.0, 96.0, 80.0),
}
# treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MiB: trees fall short of their model
# for medium sizes.
# fmt: off
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5,
     0.4, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6,
     0.6, 0.6, 0.6, 0.6, 0.8, 0.9, 0.9, 0.9, 0.9, 1.0, 1.0, 1.0),
    (0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5,
     0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9, 0.9),
)
# fmt: on
LL_EFFICIENCY = 0.5  # ring LL: 8-byte lines carry 4 data bytes
LL128_EFFICIENCY = 0.92  # ring LL128: 120 of 128 bytes are data
TREE_EFFICIENCY = 0.92  # tree all_reduce against the link
TREE_LL_FACTOR = 1 / 3.8
TREE_LL128_FACTOR_NET, TREE_LL128_FACTOR_ONE_NODE = 120 / 128, 7 / 9
PAT_EFFICIENCY = 0.75
NET_OVERHEAD_US = 1.0  # getNetOverhead on Intel (2.0 on AMD); x3 for Simple
RING_PLATEAU = 1.4  # inter-node ring Simple all_reduce latency factor on sm80+ (ncclTopoGetAlgoTime)

# --- gpuyard's own figures (not NCCL's).
# Channels NCCL opens on an NVLink system (16 on DGX A100 / H100 logs); only the per-channel caps use it.
NVLINK_CHANNELS, PCI_CHANNELS = 16, 4
# Fixed cost NCCL's tuner leaves out but every measurement carries: kernel launch and nccl-tests'
# timing. Fitted with SIMPLE_FILL_BYTES on the published corpus (a grid minimising the mean |busbw error|
# of all rows); benchmarks/collective_accuracy.py refits both and checks them leave-one-source-out
# (14-18 us, 14-20 MB when one source is held out).
LAUNCH_US = 17.0
# Simple-protocol pipeline fill: a message of ``size`` bytes pays ``size * F / (size + F)`` extra bytes
# of transfer time (all of it while small, at most F once large), because a Simple pipeline needs
# several chunks in flight per channel before it streams. NCCL's tuner has no such term; the published
# mid-size curves (8-256 MiB) all sag below it. Fitted with LAUNCH_US, same benchmark.
SIMPLE_FILL_BYTES = 16e6
# Per-peer launch cost of a direct all_to_all (one send and one receive posted per peer).
PEER_OVERHEAD_US = 0.4


@dataclass(frozen=True)
class Links:
    """Link figures a collective group sees: hop latencies (s) and bandwidths (bytes/s per rank)."""

    alpha_intra: float
    bw_intra: float
    alpha_net: float
    bw_net: float
    bw_nvls: float
    net_extra_s: float = 0.0


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


@dataclass(frozen=True)
class _Choice:
    """One (algorithm, protocol) pair: NCCL latency (us) and algorithm bandwidth (GB/s)."""

    algorithm: str
    protocol: int
    lat_us: float
    algbw_GBps: float
    plateau: bool = False  # ring Simple across nodes: latency x RING_PLATEAU once messages are large
    tree_correction: bool = False


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
    extra = 0.0 if nic.gpudirect_rdma else 2e-6
    crosses_spine = p.domains * nodes_per_domain > net.leaf_size
    if p.domains > 1 and (crosses_spine or not net.rail_optimized):
        # Off the leaf (or off the rail), a message climbs to the spine and back down.
        alpha_net += 2 * net.spine_latency_us * 1e-6
        extra += 2 * net.spine_latency_us * 1e-6
        if crosses_spine:
            nic_bytes /= net.oversubscription
        if net.spine_size is not None and p.domains * nodes_per_domain > net.spine_size:
            # Beyond one spine group (a three-tier Clos): two more switch hops and the core's ratio.
            alpha_net += 2 * net.spine_latency_us * 1e-6
            extra += 2 * net.spine_latency_us * 1e-6
            nic_bytes /= net.core_oversubscription
    share = min(1.0, p.per_domain / cluster.domain)
    return Links(
        alpha_intra=intra.latency_us * 1e-6,
        bw_intra=intra.bw_GBps * 1e9 * intra.bw_efficiency,
        alpha_net=alpha_net,
        bw_net=max(nic_bytes * share, 1.0),
        bw_nvls=intra.bw_GBps * 1e9 * intra.nvls_efficiency if intra.nvls else 0.0,
        net_extra_s=extra,
    )


def _generation(cluster: Cluster) -> str:
    """NCCL's compute-capability bucket: sm80-89 Ampere, sm90 Hopper, sm100+ Blackwell."""
    gen = cluster.intra.nvlink_generation
    if gen is None and cluster.device is None:
        gen = cluster.spec.nvlink_generation if cluster.spec else None
    if gen is not None and gen >= 5:
        return "blackwell"
    if gen == 4:
        return "hopper"
    return "ampere"


def _log2i(n: int) -> int:
    return max(0, n.bit_length() - 1)


def _nsteps(op: str, n: int) -> int:
    return 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n


@lru_cache(maxsize=1 << 12)
def _table(cluster: Cluster, op: str, gpus: int, per_domain: int) -> tuple[_Choice, ...]:
    """Every (algorithm, protocol) NCCL would weigh for ``op`` on this placement (ncclTopoTuneModel)."""
    p = Placement(gpus, per_domain, max(1, math.ceil(gpus / per_domain)))
    lk = links(cluster, p)
    n, ppn, nodes = p.gpus, p.per_domain, p.domains
    gen = _generation(cluster)
    nvlink = cluster.intra.kind in ("nvswitch", "nvlink-bridge")
    hw_intra = HW_LAT_US["nvlink" if nvlink else "pci"]
    hw_net = HW_LAT_US["net"]
    nch = NVLINK_CHANNELS if nvlink else PCI_CHANNELS
    idx2 = min(nodes, 3) - 1 if nodes <= 2 else 2
    ll_max = LL_MAX_BW_ONE_NODE[gen] if nodes == 1 else LL_MAX_BW_NET[idx2]
    # LL128 runs only over NVLink (NCCL enables it up to PATH_NVB inside the node).
    protos = (LL, LL128, SIMPLE) if nvlink else (LL, SIMPLE)
    b_intra, b_net = lk.bw_intra / 1e9, lk.bw_net / 1e9
    b_ring = b_intra if nodes == 1 else (b_net if ppn == 1 else min(b_intra, b_net))
    extra_us = lk.net_extra_s * 1e6
    nsteps = _nsteps(op, n)
    out: list[_Choice] = []

    if op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        n_inter = 0 if nodes == 1 else (2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
        for pr in protos:
            bus = b_ring
            if pr == LL:
                bus = min(ll_max, bus * LL_EFFICIENCY)
            elif pr == LL128:
                bus = min(bus * LL128_EFFICIENCY, nch * PER_CH_RING_LL128_BW[gen])
            lat = BASE_LAT_US["ring"][pr]
            if op == "broadcast":
                # Pipelined from the root: NCCL charges one hop (sameChannels rings).
                lat += (hw_intra if nodes == 1 else hw_net)["ring"][pr] + (extra_us if nodes > 1 else 0.0)
            else:
                intra_lat = hw_intra["ring"][pr]
                if nodes > 1:
                    intra_lat = max(intra_lat, NET_OVERHEAD_US * (3 if pr == SIMPLE else 1))
                # With one rank per node every hop is exposed: NCCL uses the tree's network latency.
                inter_lat = hw_net["tree" if ppn == 1 else "ring"][pr] + extra_us
                lat += (nsteps - n_inter) * intra_lat + n_inter * inter_lat
            plateau = pr == SIMPLE and nodes > 1 and op == "all_reduce"
            out.append(_Choice("ring", pr, lat, bus * n / nsteps, plateau=plateau))

    if op == "all_reduce":
        b_tree = b_intra if nodes <= 2 else min(b_intra, b_net)
        if nodes > 1 and ppn == 1:
            b_tree = b_net
        for pr in protos:
            bus = min(b_tree * TREE_EFFICIENCY, nch * PER_CH_TREE_BW[gen][idx2])
            if pr == LL:
                bus = min(bus * TREE_LL_FACTOR, ll_max)
            elif pr == LL128:
                factor = TREE_LL128_FACTOR_ONE_NODE if nodes == 1 else TREE_LL128_FACTOR_NET
                bus = min(bus * factor, nch * PER_CH_TREE_LL128_BW[gen][idx2])
            inter = hw_net["tree"][pr] + extra_us
            lat = BASE_LAT_US["tree"][pr] + 2 * ((ppn - 1) * hw_intra["tree"][pr] + _log2i(nodes) * inter)
            # A tree moves the whole buffer down and up once: algbw is half the busbw NCCL models.
            out.append(_Choice("tree", pr, lat, bus * 0.5, tree_correction=True))

    nvls_ok = lk.bw_nvls > 0 and ppn > 2
    if nvls_ok and nodes == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
        algbw = lk.bw_nvls / 1e9
        if op != "all_reduce":
            # NCCL scales NVLS by (ppn-1)/ppn for gathers instead of x2 for the reduction's two
            # pipelined halves, and does not convert busbw to algbw for them: ((n-1)/n)^2 of all_reduce's.
            algbw *= ((n - 1) / n) ** 2
        out.append(_Choice("nvls", SIMPLE, hw_intra["nvls"][SIMPLE], algbw))
    if nvls_ok and nodes > 1 and op == "all_reduce":
        # Each domain's NICs carry the reduced buffer once each way; beyond two nodes the tree's inner
        # nodes carry it twice (NCCL doubles interBw for two nodes).
        inter_alg = b_net if nodes <= 2 else b_net / 2
        per_ch = nch * PER_CH_NVLS_TREE_BW[gen][idx2] * n / nsteps
        algbw = min(lk.bw_nvls / 1e9, inter_alg, per_ch if per_ch > 0 else math.inf)
        lat = hw_intra["nvls_tree"][SIMPLE] + 2 * _log2i(nodes) * (hw_net["nvls_tree"][SIMPLE] + extra_us)
        out.append(_Choice("nvls_tree", SIMPLE, lat, algbw))

    if op in ("all_gather", "reduce_scatter") and nodes > 1 and ppn == 1:
        inter = hw_net["tree"][SIMPLE] + extra_us
        lat = BASE_LAT_US["pat"][SIMPLE] + _log2i(nodes) * inter / 3.5 + n * 2.8
        out.append(_Choice("pat", SIMPLE, lat, PAT_EFFICIENCY * b_ring))
    return tuple(out)


def _choice_time_us(c: _Choice, size: float, n: int, measured: bool = False) -> float:
    """ncclTopoGetAlgoTime: latency + bytes / bandwidth, with the tree and ring-plateau corrections.

    ``measured`` adds what NCCL's tuner leaves out but a measurement sees: the Simple pipeline fill.
    """
    lat, bw = c.lat_us, c.algbw_GBps
    if c.tree_correction:
        log_size = _log2i(int(size) >> 6) if size >= 64 else -1
        if 0 <= log_size < 23:
            bw *= TREE_CORRECTION[c.protocol][log_size]
    if c.plateau and size / (NVLINK_CHANNELS * n) >= 64:
        lat *= RING_PLATEAU
    wire = size
    if measured and c.protocol == SIMPLE and SIMPLE_FILL_BYTES > 0:
        wire += size * SIMPLE_FILL_BYTES / (size + SIMPLE_FILL_BYTES)
    return lat + wire / (1e3 * bw)


def _direct(op: str, size: float, p: Placement, lk: Links, remote_share: float | None = None) -> float:
    """all_to_all and send/recv: every peer at once over NVLink or the rank's share of the NICs (us).

    An all_to_all sends ``(n - k) / n`` of its buffer off the domain when every peer gets an equal part;
    ``remote_share`` replaces that fraction where routing bounds it (node-limited MoE routing).
    """
    n, k, m = p.gpus, p.per_domain, p.domains
    hop = BASE_LAT_US["ring"][SIMPLE] + (lk.alpha_net if m > 1 else lk.alpha_intra) * 1e6
    if op == "send_recv":
        bw = lk.bw_intra if m == 1 else lk.bw_net / k
        return hop + size / bw * 1e6
    intra_t = (k - 1) / n * size / lk.bw_intra if k > 1 else 0.0
    share = (n - k) / n if remote_share is None else remote_share
    net_t = share * size / (lk.bw_net / k) if m > 1 else 0.0
    return hop + (n - 1) * PEER_OVERHEAD_US + max(intra_t, net_t) * 1e6


def _nccl_time(
    cluster: Cluster,
    op: str,
    size: float,
    p: Placement,
    algorithm: str | None = None,
    remote_share: float | None = None,
) -> tuple[float, str, str]:
    """(seconds, protocol, algorithm) of the cheapest NCCL choice (or of the forced algorithm)."""
    if op in ("all_to_all", "send_recv"):
        if algorithm not in (None, "direct"):
            raise ConfigError(f"algorithm {algorithm!r} does not apply to {op}")
        t_us = LAUNCH_US + _direct(op, size, p, links(cluster, p), remote_share)
        return t_us * 1e-6, "Simple", "direct"
    if algorithm == "hierarchical":
        return _hierarchical(cluster, op, size, p)
    # NCCL picks by its own predicted time; the reported time adds what a measurement also pays.
    best: tuple[float, _Choice | None] = (math.inf, None)
    for c in _table(cluster, op, p.gpus, p.per_domain):
        if algorithm is not None and c.algorithm != algorithm:
            continue
        t = _choice_time_us(c, size, p.gpus)
        if t < best[0]:
            best = (t, c)
    chosen = best[1]
    if chosen is None:
        raise ConfigError(f"algorithm {algorithm!r} does not apply to {op} on {p.gpus} GPUs here")
    t_us = LAUNCH_US + _choice_time_us(chosen, size, p.gpus, measured=True)
    return t_us * 1e-6, PROTOCOLS[chosen.protocol], chosen.algorithm


def _hierarchical(cluster: Cluster, op: str, size: float, p: Placement) -> tuple[float, str, str]:
    """Reduce-scatter in the domain, all-reduce of 1/k across domains, all-gather back (forced only)."""
    if op != "all_reduce" or p.domains < 2 or p.per_domain < 2:
        raise ConfigError(f"algorithm 'hierarchical' does not apply to {op} on {p.gpus} GPUs here")
    k, m = p.per_domain, p.domains
    inner = Placement(k, k, 1)
    # k concurrent cross-domain all-reduces of 1/k each, one rank per domain: each gets 1/k of the NICs.
    t = (
        _nccl_time(cluster, "reduce_scatter", size, inner)[0]
        + _nccl_time(cluster, "all_reduce", size / k, Placement(m, 1, m))[0]
        + _nccl_time(cluster, "all_gather", size, inner)[0]
    )
    return t, "Simple", "hierarchical"


def _alpha_beta_time(
    cluster: Cluster, op: str, size: float, p: Placement, remote_share: float | None = None
) -> tuple[float, str, str]:
    """Clusters calibrated by ``gpuyard fabric bench`` (gloo and the like): one hop latency, one bandwidth."""
    lk = links(cluster, p)
    n, k, m = p.gpus, p.per_domain, p.domains
    if m == 1:
        hop, bw = lk.alpha_intra, lk.bw_intra
    elif k == 1:
        hop, bw = lk.alpha_net, lk.bw_net
    else:
        hop, bw = ((k - 1) * lk.alpha_intra + lk.alpha_net) / k, min(lk.bw_intra, lk.bw_net)
    if op in ("all_to_all", "send_recv"):
        t_us = _direct(op, size, p, lk, remote_share) - BASE_LAT_US["ring"][SIMPLE]
        return t_us * 1e-6, "alpha-beta", "direct"
    steps = _nsteps(op, n)
    wire = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n) * size
    return steps * hop + wire / bw, "alpha-beta", "ring"


def _time(
    cluster: Cluster,
    op: str,
    size: float,
    p: Placement,
    algorithm: str | None = None,
    remote_share: float | None = None,
) -> tuple[float, str, str]:
    if p.gpus <= 1:
        return 0.0, "none", "local"
    if cluster.torus is not None:  # a TPU slice: rings along the ICI torus (gpuyard.fabric.torus)
        if algorithm not in (None, "ring"):
            raise ConfigError(f"algorithm {algorithm!r} does not apply to a TPU slice (torus rings only)")
        return torus_time(cluster, op, size, p.gpus, p.per_domain), "ici", "torus-ring"
    if cluster.collective_model == "alpha-beta":
        if algorithm not in (None, "ring", "direct"):
            raise ConfigError(f"algorithm {algorithm!r} does not apply to an alpha-beta cluster")
        return _alpha_beta_time(cluster, op, size, p, remote_share)
    return _nccl_time(cluster, op, size, p, algorithm, remote_share)


@lru_cache(maxsize=1 << 16)
def collective_time(
    cluster: Cluster,
    op: str,
    size_bytes: float,
    gpus: int,
    per_domain: int | None = None,
    remote_share: float | None = None,
) -> float:
    """Seconds for one collective of ``size_bytes`` over ``gpus`` ranks (the planner's entry point).

    Args:
        cluster: the cluster.
        op: one of :data:`OPS`.
        size_bytes: nccl-tests' size (the full buffer: output of all_gather, input of reduce_scatter).
        gpus: ranks in the group.
        per_domain: ranks of the group inside one NVLink domain (default: as packed as possible).
        remote_share: all_to_all only: the fraction of the buffer that leaves the domain, where routing
            bounds it (default: every peer's equal part, (n - k) / n).

    Returns:
        The time of NCCL's cheapest (algorithm, protocol) for this size, launch cost included.

    Memoised: the planner asks for the same few collectives across thousands of layouts.
    """
    return _time(cluster, op, float(size_bytes), place(cluster, gpus, per_domain), None, remote_share)[0]


def clear_caches() -> None:
    """Forget the memoised collective times and algorithm tables (for cold-cache timings)."""
    collective_time.cache_clear()
    _table.cache_clear()


def estimate(
    cluster: Cluster, op: str, gpus: int, size_bytes: int, algorithm: str | None = None
) -> CollectiveEstimate:
    """Model one collective the way nccl-tests would report it.

    Args:
        cluster: the cluster (GPUs are packed into whole nodes, as many as needed).
        op: one of :data:`OPS`.
        gpus: ranks taking part.
        size_bytes: message size in nccl-tests' convention.
        algorithm: force one algorithm (as ``NCCL_ALGO`` does) instead of NCCL's choice.

    Returns:
        The chosen algorithm and protocol, the time, algbw and busbw.

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
    t, proto, algo = _time(cluster, op, float(size_bytes), p, algorithm)
    algbw = size_bytes / t / 1e9 if t > 0 else 0.0
    busbw = algbw * bus_factor(op, gpus)
    return CollectiveEstimate(op, gpus, size_bytes, algo, proto, t, algbw_GBps=algbw, busbw_GBps=busbw)


estimate_collective = estimate
