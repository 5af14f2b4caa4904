"""Slurm's ``topology.conf`` (topology/tree) both ways: written from a cluster description, read into one.

Written: the cluster's leaf switches (``network.leaf_size`` nodes each), its spine groups
(``network.spine_size`` nodes each, when set and smaller than the cluster) and one top switch, so
Slurm's own topology-aware selection sees the same switches gpuyard's fabric model costs.

Read: each level-0 switch's nodes are a leaf; the nodes under one level-1 switch are a spine group;
the leaf and spine sizes of the cluster model become the largest seen, and the node count the nodes
listed. The Slurm executor reads the same tree from ``scontrol show topology`` for placement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuyard.errors import ConfigError
from gpuyard.fabric.cluster import Cluster

MAX_HOSTS = 1_000_000


def hostlist_expand(expr: str) -> list[str]:
    """Expand a Slurm host list (``gpu[001-004,010],login1``) into names, in order.

    Raises:
        ConfigError: an unbalanced bracket, a reversed range or more than a million names.
    """
    names: list[str] = []
    for part in _split_top(expr.strip()):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if not match:
            if "[" in part or "]" in part:
                raise ConfigError(f"host list {part!r}: unbalanced or nested brackets")
            if part:
                names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigError(f"host list {part!r}: {item!r} is not a number or range")
            width = len(lo) if lo.startswith("0") else 0
            a, b = int(lo), int(hi) if hi else int(lo)
            if b < a:
                raise ConfigError(f"host list {part!r}: range {item} runs backwards")
            if len(names) + (b - a + 1) > MAX_HOSTS:
                raise ConfigError(f"host list {expr[:80]!r}: more than {MAX_HOSTS} names")
            names.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(a, b + 1))
    return names


def _split_top(expr: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def hostlist_compress(names: list[str]) -> str:
    """The shortest-form host list of ``names`` (runs of one prefix and number width become ranges)."""
    out: list[str] = []
    groups: dict[tuple[str, int, str], list[int]] = {}
    order: list[tuple[str, int, str]] = []
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)(\D*)", name)
        if not match:
            out.append(name)
            continue
        prefix, digits, suffix = match.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        key = (prefix, width, suffix)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    for key in order:
        prefix, width, suffix = key
        nums = sorted(set(groups[key]))
        runs, start, prev = [], nums[0], nums[0]
        for n in nums[1:]:
            if n == prev + 1:
                prev = n
                continue
            runs.append((start, prev))
            start = prev = n
        runs.append((start, prev))
        text = ",".join(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in runs)
        out.append(f"{prefix}{text}{suffix}" if len(nums) == 1 else f"{prefix}[{text}]{suffix}")
    return ",".join(out)


@dataclass
class SlurmTopology:
    """A topology/tree: each switch's nodes (level 0) or child switches (higher levels)."""

    nodes: dict[str, list[str]] = field(default_factory=dict)
    switches: dict[str, list[str]] = field(default_factory=dict)

    def leaf_of(self) -> dict[str, str]:
        """node -> its level-0 switch (the first one that lists it)."""
        out: dict[str, str] = {}
        for switch, nodes in self.nodes.items():
            for node in nodes:
                out.setdefault(node, switch)
        return out

    def under(self, switch: str, seen: frozenset[str] = frozenset()) -> list[str]:
        """Every node below ``switch``."""
        if switch in seen:
            raise ConfigError(f"topology.conf: switch {switch!r} is its own ancestor")
        found = list(self.nodes.get(switch, []))
        for child in self.switches.get(switch, []):
            found += self.under(child, seen | {switch})
        return found

    def to_conf(self) -> str:
        """The topology.conf text."""
        lines = [f"SwitchName={s} Nodes={hostlist_compress(n)}" for s, n in self.nodes.items()]
        lines += [f"SwitchName={s} Switches={','.join(c)}" for s, c in self.switches.items()]
        return "\n".join(lines) + "\n"


def parse_topology(text: str) -> SlurmTopology:
    """Read a topology.conf (``SwitchName=... Nodes=...`` / ``Switches=...`` lines; # comments).

    Raises:
        ConfigError: a line without SwitchName, a switch with neither nodes nor switches, a child
            switch never defined, a switch defined twice, or no switch at all (the line is named).
    """
    topo = SlurmTopology()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        keys = {k.lower(): v for k, v in fields.items()}
        name = keys.get("switchname")
        if not name:
            raise ConfigError(f"topology.conf line {number}: no SwitchName= ({raw.strip()[:80]!r})")
        if name in topo.nodes or name in topo.switches:
            raise ConfigError(f"topology.conf line {number}: switch {name!r} defined twice")
        if keys.get("nodes"):
            topo.nodes[name] = hostlist_expand(keys["nodes"])
        elif keys.get("switches"):
            topo.switches[name] = hostlist_expand(keys["switches"])
        else:
            raise ConfigError(
                f"topology.conf line {number}: switch {name!r} has neither Nodes= nor Switches="
            )
    if not topo.nodes:
        raise ConfigError("topology.conf: no switch lists nodes")
    known = set(topo.nodes) | set(topo.switches)
    for switch, children in topo.switches.items():
        missing = [c for c in children if c not in known]
        if missing:
            raise ConfigError(f"topology.conf: switch {switch!r} names undefined switches {missing}")
        topo.under(switch)  # no cycles
    return topo


def topology_for(cluster: Cluster, names: list[str]) -> SlurmTopology:
    """The tree of ``names`` (in order) under ``cluster``'s network: leaves of ``leaf_size`` nodes,
    spine groups of ``spine_size`` nodes when that splits the cluster, one top switch over them."""
    if not names:
        raise ConfigError("a topology needs at least one node")
    leaf_size = cluster.network.leaf_size
    topo = SlurmTopology()
    leaves = [f"leaf{i}" for i in range((len(names) + leaf_size - 1) // leaf_size)]
    for i, leaf in enumerate(leaves):
        topo.nodes[leaf] = names[i * leaf_size : (i + 1) * leaf_size]
    if len(leaves) == 1:
        return topo
    spine = cluster.network.spine_size
    per_spine = max(1, spine // leaf_size) if spine and spine < len(names) else len(leaves)
    spines = [leaves[i : i + per_spine] for i in range(0, len(leaves), per_spine)]
    if len(spines) == 1:
        topo.switches["spine0"] = leaves
        return topo
    for i, group in enumerate(spines):
        topo.switches[f"spine{i}"] = group
    topo.switches["core"] = [f"spine{i}" for i in range(len(spines))]
    return topo


def cluster_from_topology(cluster: Cluster, topo: SlurmTopology) -> Cluster:
    """``cluster`` with its node count, leaf size and spine size taken from a Slurm tree."""
    nodes = sorted({n for ns in topo.nodes.values() for n in ns})
    leaf_size = max(len(ns) for ns in topo.nodes.values())
    level1 = [s for s, children in topo.switches.items() if all(c in topo.nodes for c in children)]
    top = [s for s in topo.switches if not any(s in c for c in topo.switches.values())]
    network = {"leaf_size": leaf_size}
    if len(level1) > 1 and len(top) >= 1:
        network["spine_size"] = max(len(topo.under(s)) for s in level1)
    return cluster.model_copy(
        update={"nodes": len(nodes), "network": cluster.network.model_copy(update=network)}
    )
