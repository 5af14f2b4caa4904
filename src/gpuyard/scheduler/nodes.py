"""Where the scheduler's node list comes from: this machine's inventory, or a fabric cluster description."""

from __future__ import annotations

import os
import socket
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.scheduler.placement import NodeSpec

FAKE_GPU_TYPE = "fake-gpu"


def node_from_inventory(
    doc: dict[str, Any], fake_gpus: int | None = None, cpus: int | None = None
) -> NodeSpec:
    """One node from a `gpuyard hw --json` document; GPUs whose health is "fail" are excluded.

    Args:
        doc: the inventory (``probe_node().to_dict()``).
        fake_gpus: pretend the node has this many GPUs of type ``fake-gpu`` (to try placement on a
            GPU-less machine; the jobs get ``CUDA_VISIBLE_DEVICES`` but there is no device behind it).
        cpus: CPU slots for CPU-only jobs (default: the node's cores).
    """
    node = doc.get("node", doc)
    cores = (node.get("cpu") or {}).get("cores") or os.cpu_count() or 1
    name = node.get("hostname") or socket.gethostname()
    if fake_gpus is not None:
        if fake_gpus < 0:
            raise ConfigError(f"--gpus {fake_gpus}: must be >= 0")
        return NodeSpec(
            name=name,
            gpus=fake_gpus,
            gpu_type=FAKE_GPU_TYPE if fake_gpus else "",
            nvlink_domain=name,
            leaf="local",
            cpus=cpus or cores,
        )
    accels = node.get("accelerators") or []
    excluded = frozenset(i for i, a in enumerate(accels) if a.get("health") == "fail")
    gpu_type = str(accels[0].get("name") or accels[0].get("kind") or "gpu") if accels else ""
    return NodeSpec(
        name=name,
        gpus=len(accels),
        gpu_type=gpu_type,
        nvlink_domain=name,
        leaf="local",
        excluded=excluded,
        cpus=cpus or cores,
    )


def local_node(fake_gpus: int | None = None, cpus: int | None = None, record: bool = False) -> NodeSpec:
    """This machine as one node, from the hardware probe.

    Args:
        fake_gpus: GPU slots to pretend this node has (testing placement on a GPU-less machine).
        cpus: CPU slots (default: the usable cores).
        record: also store the probed inventory in the state store's ``nodes`` table (the server does,
            so the dashboard and API show the machine it schedules on).
    """
    from gpuyard.hardware.probe import probe_node

    inventory = probe_node()
    if record:
        from gpuyard.hardware.record import record_inventory

        record_inventory(inventory)
    return node_from_inventory(inventory.to_dict(), fake_gpus=fake_gpus, cpus=cpus)


def nodes_from_fabric(cluster: Any, nodes: int | None = None) -> list[NodeSpec]:
    """Nodes of a :class:`gpuyard.fabric.cluster.Cluster`: NVLink domains and leaf switches from its model.

    Args:
        cluster: the fabric cluster (``gpuyard.fabric.cluster.load_cluster(name)``).
        nodes: node count when the description leaves it open.

    Raises:
        ConfigError: the description has no node count and none was given.
    """
    count = nodes or cluster.nodes
    if not count:
        raise ConfigError(f"cluster {cluster.name!r} does not fix its node count; give --nodes")
    per_domain = max(1, cluster.domain // cluster.gpus_per_node)
    per_leaf = max(1, cluster.network.leaf_size)
    return [
        NodeSpec(
            name=f"{cluster.name}-{i:04d}",
            gpus=cluster.gpus_per_node,
            gpu_type=cluster.accelerator,
            nvlink_domain=f"nvl{i // per_domain}",
            leaf=f"leaf{i // per_leaf}",
        )
        for i in range(count)
    ]


def with_network(cluster: Any, leaf_size: int | None = None, oversubscription: float | None = None) -> Any:
    """A fabric cluster with its leaf size (nodes per leaf switch) and spine oversubscription replaced.

    Args:
        cluster: a :class:`gpuyard.fabric.cluster.Cluster`.
        leaf_size: nodes under one leaf switch (None: keep the cluster's).
        oversubscription: leaf downlink : uplink ratio (None: keep the cluster's).
    """
    update: dict[str, Any] = {}
    if leaf_size is not None:
        update["leaf_size"] = leaf_size
    if oversubscription is not None:
        if oversubscription < 1:
            raise ConfigError(f"oversubscription {oversubscription}: must be at least 1")
        update["oversubscription"] = float(oversubscription)
    if not update:
        return cluster
    return cluster.model_copy(update={"network": cluster.network.model_copy(update=update)})


def check_fabric_nodes(cluster: Any, nodes: list[NodeSpec]) -> None:
    """Refuse a fabric cluster that does not describe the scheduler's nodes.

    The fabric model costs a job by how its GPUs sit in NVLink domains, with each GPU's share of its
    node's NICs (``gpus_per_node``); the scheduler takes each node as one NVLink domain. So every node
    with GPUs must have ``gpus_per_node`` GPUs (unhealthy ones count: they are still in the box), and
    the cluster's domains must be whole nodes (or, on a single node, larger). The node count is not
    compared: a placement is costed on the job's own GPUs, whatever the cluster's size; nor is the GPU
    type (fake GPUs are costed as the cluster's accelerator).

    Args:
        cluster: the fabric cluster (:class:`gpuyard.fabric.cluster.Cluster`).
        nodes: the scheduler's nodes.

    Raises:
        ConfigError: no node has GPUs, a node's GPU count is not the cluster's, or the cluster's NVLink
            domains are not whole nodes (the message says which and what to give instead).
    """
    per_node, domain, name = cluster.gpus_per_node, cluster.domain, cluster.name
    gpu_nodes = [n for n in nodes if n.gpus]
    if not gpu_nodes:
        raise ConfigError("fabric placement places GPU jobs, and no node here has GPUs (--gpus N pretends)")
    for n in gpu_nodes:
        if n.gpus != per_node:
            hint = (
                f"give --gpus {per_node}"
                if n.gpu_type == FAKE_GPU_TYPE
                else f"describe the nodes in a cluster file with gpus_per_node: {n.gpus}"
            )
            raise ConfigError(
                f"cluster {name!r} has {per_node} GPUs per node, but node {n.name!r} has {n.gpus}: "
                f"its jobs would be costed on other hardware; {hint}"
            )
    if domain < per_node:
        raise ConfigError(
            f"cluster {name!r} splits a node into NVLink domains of {domain} GPUs; the scheduler "
            "takes each node as one domain"
        )
    if domain > per_node and len(gpu_nodes) > 1:
        raise ConfigError(
            f"cluster {name!r} has NVLink domains of {domain} GPUs across nodes, but these nodes do not "
            "say which of them share one (each would be costed as a domain of its own)"
        )
