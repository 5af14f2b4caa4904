"""Cluster presets and files, sizes, the `local` preset from an inventory, and the fabric CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.cli.main import main
from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.fabric.local import cluster_from_inventory
from gpuyard.fabric.presets import list_presets, load_cluster, save_cluster
from gpuyard.fabric.units import format_size, parse_size, parse_size_range

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "hgx-h200", "gb200-nvl72", "pcie-l40s"])
def test_presets_load_and_describe_the_issue_hardware(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.spec is not None and cluster.peak_tflops > 0
    assert name in list_presets()


def test_preset_figures_match_the_issue() -> None:
    a100, h100 = load_cluster("dgx-a100"), load_cluster("dgx-h100")
    assert (a100.gpus_per_node, a100.intra.nvlink_generation, a100.nic.count, a100.nic.gbps) == (8, 3, 8, 200)
    assert (h100.intra.nvlink_generation, h100.nic.gbps, h100.intra.nvls) == (4, 400, True)
    assert load_cluster("gb200-nvl72").domain == 72
    l40s = load_cluster("pcie-l40s")
    assert (l40s.intra.kind, l40s.nic.count, l40s.nic.gbps, l40s.nic.kind) == ("pcie", 2, 100, "roce")


def test_cluster_file_round_trip_and_field_errors(tmp_path: Path) -> None:
    original = load_cluster("dgx-h100")
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"c{suffix}"
        save_cluster(original, path)
        assert load_cluster(str(path)) == original
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\naccelerator: H100\ngpus_per_node: 0\n"
        "intra: {kind: pcie, bw_GBps: 1, latency_us: 1}\n"
        "nic: {count: 1, gbps: 100, kind: roce, latency_us: 1}\n"
    )
    with pytest.raises(ConfigError, match="gpus_per_node"):
        load_cluster(str(bad))
    bad.write_text(bad.read_text().replace("gpus_per_node: 0", "gpus_per_node: 8").replace("H100", "V100"))
    with pytest.raises(ConfigError, match="accelerator"):
        load_cluster(str(bad))
    with pytest.raises(NotFoundError, match="dgx-a100"):
        load_cluster("dgx-a1000")


def test_sizes() -> None:
    assert parse_size("64MiB") == 64 << 20 and parse_size("1GB") == 10**9 and parse_size("512") == 512
    assert parse_size_range("1KiB:8KiB") == [1024, 2048, 4096, 8192]
    assert format_size(1536) == "1.5KiB" and format_size(1 << 30) == "1GiB"
    for text in ("12XB", "", "0B", "8KiB:1KiB"):
        with pytest.raises(ConfigError):
            parse_size_range(text)


def test_local_cluster_from_cpu_only_and_gpu_inventories() -> None:
    cpu = cluster_from_inventory(
        {
            "node": {
                "hostname": "h",
                "accelerators": [],
                "nics": [],
                "cpu": {"model": "x", "cores": 4, "memory_bytes": 8 << 30, "isa": ["avx2", "fma"]},
            }
        }
    )
    assert cpu.gpus_per_node == 1 and cpu.intra.kind == "loopback" and cpu.device is not None
    assert cpu.device_memory_bytes == 8 << 30 and cpu.peak_tflops == pytest.approx(4 * 32 * 2.5e-3)
    gpu = {"name": "NVIDIA H100 80GB HBM3", "kind": "gpu", "memory_bytes": 80 << 30, "nvlink": [{"link": 0}]}
    gpus = [gpu]
    nics = [{"name": f"mlx5_{i}", "rate_gbps": 400, "link_layer": "InfiniBand"} for i in range(8)]
    h100 = cluster_from_inventory({"node": {"hostname": "h", "accelerators": gpus * 8, "nics": nics}})
    assert (h100.accelerator, h100.gpus_per_node, h100.intra.kind, h100.intra.bw_GBps) == (
        "H100-SXM5-80GB",
        8,
        "nvswitch",
        450,
    )
    assert (h100.nic.count, h100.nic.kind) == (8, "infiniband")
    with pytest.raises(ConfigError, match="catalog"):
        cluster_from_inventory({"node": {"accelerators": [{"name": "NVIDIA Tesla K80"}]}})


def test_local_preset_never_crashes_here() -> None:
    cluster = load_cluster("local")
    assert cluster.gpus_per_node >= 1 and cluster.device_memory_bytes > 0


def test_cli_collective_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ok:
        main(["fabric", "collective", "--cluster", "dgx-a100", "--gpus", "8", "--size", "64MiB", "--json"])
    assert ok.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"op", "gpus", "size_bytes", "algorithm", "time_s", "algbw_GBps", "busbw_GBps"} <= set(out)
    assert out["size_bytes"] == 64 << 20
    with pytest.raises(SystemExit) as info:
        main(["fabric", "collective", "--cluster", "nope", "--gpus", "8"])
    assert info.value.code == 2
    assert "unknown cluster" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("h100_hgx", ("H100-SXM5-80GB", 8, "nvswitch", 8, 400.0, "infiniband")),
        ("l40s_pcie", ("L40S-48GB", 4, "pcie", 2, 100.0, "roce")),
    ],
)
def test_local_cluster_from_the_hardware_fixtures(
    tmp_path: Path, fixture: str, expected: tuple[object, ...]
) -> None:
    # The recorded nodes of the hardware tests (public nvidia-smi outputs), probed through the real prober.
    from gpuyard.hardware.fake import FakeNvml, load_description, write_host_tree
    from gpuyard.hardware.probe import probe_node
    from gpuyard.hardware.sysfs import HostRoots

    desc = load_description(Path(__file__).parents[1] / "hardware" / "fixtures" / f"{fixture}.json")
    root = write_host_tree(desc, tmp_path / "host")
    inventory = probe_node(FakeNvml(desc), roots=HostRoots.under(root), frameworks=False, hostname="fx")
    c = cluster_from_inventory(inventory.to_dict())
    assert (c.accelerator, c.gpus_per_node, c.intra.kind, c.nic.count, c.nic.gbps, c.nic.kind) == expected
