"""Slurm's topology.conf both ways: host lists, the tree written from a cluster, read back into one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuyard.errors import ConfigError
from gpuyard.fabric.presets import load_cluster
from gpuyard.fabric.slurm_topology import (
    cluster_from_topology,
    hostlist_compress,
    hostlist_expand,
    parse_topology,
    topology_for,
)

pytestmark = pytest.mark.unit


def test_host_lists_expand_with_ranges_widths_and_plain_names() -> None:
    assert hostlist_expand("gpu[008-010,012],login1") == ["gpu008", "gpu009", "gpu010", "gpu012", "login1"]
    assert hostlist_expand("n[1-3]-ib") == ["n1-ib", "n2-ib", "n3-ib"]


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu[3-1]", "gpu[a-b]", "gpu[[1]]"])
def test_bad_host_lists_are_one_line_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="host list"):
        hostlist_expand(bad)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=40, unique=True))
def test_compress_then_expand_gives_the_names_back(nums: list[int]) -> None:
    names = [f"gpu{n:03d}" for n in sorted(nums)]
    assert hostlist_expand(hostlist_compress(names)) == names


def test_a_cluster_becomes_leaves_spines_and_a_core_and_reads_back_the_same_sizes() -> None:
    base = load_cluster("dgx-h100")
    cluster = base.model_copy(
        update={"network": base.network.model_copy(update={"leaf_size": 4, "spine_size": 8})}
    )
    names = [f"gpu{i:03d}" for i in range(20)]
    topo = topology_for(cluster, names)
    assert topo.nodes["leaf0"] == names[:4] and len(topo.nodes) == 5
    assert topo.switches["spine0"] == ["leaf0", "leaf1"] and topo.switches["core"] == [
        "spine0",
        "spine1",
        "spine2",
    ]
    read = parse_topology(topo.to_conf())
    assert read.leaf_of() == topo.leaf_of()
    back = cluster_from_topology(base, read)
    assert (back.nodes, back.network.leaf_size, back.network.spine_size) == (20, 4, 8)


def test_topology_conf_errors_name_the_line() -> None:
    with pytest.raises(ConfigError, match="line 2"):
        parse_topology("SwitchName=s1 Nodes=n1\nNodes=n2\n")
    with pytest.raises(ConfigError, match="undefined switches"):
        parse_topology("SwitchName=s1 Nodes=n1\nSwitchName=top Switches=s1,s9\n")
    with pytest.raises(ConfigError, match="own ancestor"):
        parse_topology("SwitchName=s1 Nodes=n1\nSwitchName=a Switches=b\nSwitchName=b Switches=a\n")
