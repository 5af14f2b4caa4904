"""Fixtures of the hardware tests: recorded node descriptions laid out as /proc + /sys trees."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuyard.hardware.fake import FakeNvml, load_description, write_host_tree
from gpuyard.hardware.inventory import NodeInventory
from gpuyard.hardware.probe import probe_node
from gpuyard.hardware.sysfs import HostRoots

FIXTURES = Path(__file__).parent / "fixtures"

Probe = Callable[..., NodeInventory]


@pytest.fixture
def fixtures_dir() -> Path:
    """The folder of recorded node descriptions and topo -m outputs."""
    return FIXTURES


@pytest.fixture
def description() -> Callable[[str], dict[str, Any]]:
    """A fresh, mutable copy of a recorded node description (``h100_hgx`` or ``l40s_pcie``)."""

    def load(name: str) -> dict[str, Any]:
        return copy.deepcopy(load_description(FIXTURES / f"{name}.json"))

    return load


@pytest.fixture
def probe_description(tmp_path: Path) -> Probe:
    """Probe a node description: its /proc and /sys are written under tmp_path, NVML is faked."""
    counter = iter(range(1000))

    def run(desc: dict[str, Any], **kwargs: Any) -> NodeInventory:
        root = write_host_tree(desc, tmp_path / f"host{next(counter)}")
        kwargs.setdefault("frameworks", False)
        kwargs.setdefault("hostname", "fixture")
        return probe_node(FakeNvml(desc), roots=HostRoots.under(root), **kwargs)

    return run


@pytest.fixture
def probe_fixture(description: Callable[[str], dict[str, Any]], probe_description: Probe) -> Probe:
    """Probe a recorded node by name, optionally after ``mutate(description)``."""

    def run(
        name: str, mutate: Callable[[dict[str, Any]], None] | None = None, **kwargs: Any
    ) -> NodeInventory:
        desc = description(name)
        if mutate is not None:
            mutate(desc)
        return probe_description(desc, **kwargs)

    return run
