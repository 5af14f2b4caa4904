"""Collectives on a TPU slice: rings along the dimensions of an ICI torus, the network between slices.

The model (each step below is what the functions compute; figures are per chip):

**Links.** A slice is a torus of ``dims`` chips (3D for TPU v4 / v5p, 2D for v5e / v6e). Every chip has
one link to each of its two neighbours along every dimension, and a link carries ``B`` bytes/s in each
direction (``Torus.link_GBps`` x ``bw_efficiency``). With wraparound a whole dimension is a ring;
without it (or when a group uses only part of a dimension) it is a line.

**Group shape.** A group of ``n`` chips is taken as a block ``(k_1, ..., k_D)`` with ``prod k = n``, filled
from the first dimension: ``k_i = gcd(rest, d_i)``. A dimension the group spans whole keeps its
wraparound. (Where a group sits in the slice, its stride behind faster-varying groups, is not modelled:
a data-parallel group behind tensor parallelism gets the same block shape as a packed one.)

**Reduce-scatter along one dimension** of ``k`` chips, buffer ``S``: a ring reduce-scatter sends
``(k-1)/k x S`` from each chip. On a ring (wraparound) two counter-rotating rings each take half of the
buffer, so both directions of every link work: ``(k-1)/k x S / 2B``. On a line a ring must come back
along the same links, so each link direction carries the whole ring's traffic: ``(k-1)/k x S / B``.

**Several dimensions at once.** The buffer is cut into ``D`` shards (one per used dimension); shard
``j`` reduce-scatters along dimensions ``j, j+1, ...`` in turn, each step on ``1/k`` of what the step
before left. Every dimension's links therefore work all the time: dimension ``i`` carries, for each shard,
``(k_i - 1)/k_i x (S/D) / prod(k of the dimensions that shard visited before i)``. The dimensions run
concurrently, so the reduce-scatter takes the largest of their loads over their bandwidths, plus one
hop latency per ring step (``sum (k_i - 1)``). For equal ``k`` this is ``(n-1)/n x S / (2 D B)`` on a
torus: ``D`` times a single bidirectional ring.

**all_gather** is the reverse of reduce-scatter (same time); **all_reduce** is reduce-scatter then
all-gather (twice the time).

**all_to_all** is bound by the bisection: each chip sends ``S/n`` to every other chip, routed
dimension by dimension; across the middle of a dimension of ``k`` chips pass ``S x k / 4`` bytes per
chip-column on a line (one link each way) and the same over two cuts on a ring, so the time along
dimension ``i`` is ``S k_i / (4B)`` on a line and ``S k_i / (8B)`` on a ring; dimensions run at once.

**send_recv** is one link: ``S / B`` plus a hop.

**Between slices** (a group larger than one slice) the data-center network joins them: reduce-scatter
inside each slice over ICI, then a ring across the ``m`` slices over the NICs on the ``1/k`` shard each
chip holds (every chip's share of its host's NICs: ``count x Gb/s / 8 / chips per host`` x efficiency),
then all-gather back inside the slice. This is the hierarchy MaxText's multislice layouts rely on
(data parallelism over DCN, everything else over ICI).

No NCCL-style protocol choice, launch cost or small-message regime is modelled: XLA schedules the
collectives itself and publishes no tuner to follow. The per-hop latency (1 us) and the 0.9 link
efficiency are gpuyard's assumptions, not published figures.
"""

from __future__ import annotations

import math

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster, Torus

TORUS_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def group_shape(torus: Torus, n: int) -> list[tuple[int, bool]]:
    """The block a group of ``n`` chips occupies: ``(chips, is_ring)`` per used dimension.

    Raises:
        ConfigError: ``n`` does not fill a block of the slice (it is not a product of divisors of the
            dimensions, e.g. 3 chips on a 4x4 slice).
    """
    rest, out = n, []
    for d in torus.dims:
        k = math.gcd(rest, d)
        if k > 1:
            out.append((k, torus.wraparound and k == d and k > 2))
        rest //= k
    if rest != 1:
        raise ConfigError(f"a group of {n} chips does not fill a block of the {_shape(torus)} torus")
    return out


def _shape(torus: Torus) -> str:
    return "x".join(str(d) for d in torus.dims)


def _reduce_scatter_s(torus: Torus, size: float, n: int) -> float:
    """Seconds of a reduce-scatter of ``size`` bytes over a block of ``n`` chips (see the module text)."""
    shape = group_shape(torus, n)
    if not shape:
        return 0.0
    b = torus.link_GBps * 1e9 * torus.bw_efficiency
    dims = len(shape)
    load = [0.0] * dims
    for start in range(dims):  # shard `start` visits dimensions start, start+1, ... (rotated)
        remaining = size / dims
        for step in range(dims):
            i = (start + step) % dims
            k, _ = shape[i]
            load[i] += (k - 1) / k * remaining
            remaining /= k
    bandwidth = [2 * b if ring else b for _, ring in shape]
    wire = max(load[i] / bandwidth[i] for i in range(dims))
    hops = sum(k - 1 for k, _ in shape)
    return wire + hops * torus.latency_us * 1e-6


def _all_to_all_s(torus: Torus, size: float, n: int) -> float:
    shape = group_shape(torus, n)
    if not shape:
        return 0.0
    b = torus.link_GBps * 1e9 * torus.bw_efficiency
    wire = max(size * k / ((8 if ring else 4) * b) for k, ring in shape)
    return wire + sum(k // 2 for k, _ in shape) * torus.latency_us * 1e-6


def _in_slice_s(torus: Torus, op: str, size: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * _reduce_scatter_s(torus, size, n)
    if op in ("reduce_scatter", "all_gather", "broadcast"):
        return _reduce_scatter_s(torus, size, n)
    if op == "all_to_all":
        return _all_to_all_s(torus, size, n)
    if op == "send_recv":
        return size / (torus.link_GBps * 1e9 * torus.bw_efficiency) + torus.latency_us * 1e-6
    raise ConfigError(f"unknown op {op!r}; known: {', '.join(TORUS_OPS)}")


def dcn_bytes_per_chip(cluster: Cluster, slices: int) -> float:
    """Bytes/s one chip gets on the data-center network (its share of its host's NICs), per direction."""
    nic = cluster.nic
    bw = nic.count * nic.gbps / 8 * 1e9 * nic.bw_efficiency / cluster.gpus_per_node
    hosts = slices * cluster.domain // cluster.gpus_per_node
    if hosts > cluster.network.leaf_size:
        bw /= cluster.network.oversubscription
    return max(bw, 1.0)


def torus_time(cluster: Cluster, op: str, size: float, gpus: int, per_slice: int) -> float:
    """Seconds of one collective of ``size`` bytes over ``gpus`` chips, ``per_slice`` in each slice.

    Raises:
        ConfigError: the cluster has no torus, the op is unknown, or a group does not fill a block.
    """
    torus = cluster.torus
    if torus is None:
        raise ConfigError(f"cluster {cluster.name!r} has no ICI torus")
    if op not in TORUS_OPS:
        raise ConfigError(f"unknown op {op!r}; known: {', '.join(TORUS_OPS)}")
    if gpus <= 1:
        return 0.0
    k = max(1, min(per_slice, gpus))
    slices = max(1, math.ceil(gpus / k))
    inside = _in_slice_s(torus, op, size, k)
    if slices == 1:
        return inside
    dcn = dcn_bytes_per_chip(cluster, slices)
    hop = cluster.nic.latency_us * 1e-6
    m = slices
    if op == "all_reduce":
        across = 2 * (m - 1) / m * size / k / dcn + 2 * (m - 1) * hop
    elif op in ("reduce_scatter", "all_gather", "broadcast"):
        across = (m - 1) / m * size / k / dcn + (m - 1) * hop
    elif op == "all_to_all":  # (m-1)/m of every chip's buffer leaves its slice
        across = (m - 1) / m * size / dcn + hop
    else:  # send_recv between two slices
        return size / dcn + hop
    return inside + across
