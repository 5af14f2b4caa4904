"""probe_node over the fake NVML and recorded trees, and over this GPU-less machine."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpuyard.hardware.fake import FakeNvml
from gpuyard.hardware.nvml import open_nvml
from gpuyard.hardware.probe import probe_node

pytestmark = pytest.mark.unit

CONTRACT_CPU = {"model", "cores", "memory_bytes", "isa", "numa_nodes"}
CONTRACT_ACCEL = {
    "index",
    "kind",
    "name",
    "uuid",
    "memory_bytes",
    "compute_capability",
    "nvlink",
    "pcie",
    "numa",
    "health",
}


def _assert_contract(doc: dict) -> None:
    node = doc["node"]
    assert {"hostname", "cpu", "accelerators", "topology", "nics"} <= set(node)
    assert set(node["cpu"]) >= CONTRACT_CPU
    for a in node["accelerators"]:
        assert set(a) >= CONTRACT_ACCEL
    json.dumps(doc)  # plain JSON all the way down


def test_h100_node_every_issue_field(probe_fixture) -> None:
    inv = probe_fixture("h100_hgx")
    doc = inv.to_dict()
    _assert_contract(doc)
    gpus = doc["node"]["accelerators"]
    assert len(gpus) == 8 and inv.health == "pass"
    g = gpus[5]
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["kind"] == "cuda" and g["uuid"].startswith("GPU-")
    assert g["memory_bytes"] == 81559 * 2**20 and g["compute_capability"] == "9.0"
    assert g["pcie"] == {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16}
    assert g["numa"] == 1 and g["cpu_affinity"] == "80-159" and g["bus_id"] == "0000:ab:00.0"
    # NVML answers code 6 for NVLink 4.0; the document carries the NVLink version, not the code.
    assert g["nvlink"]["version"] == "4.0" and g["nvlink"]["generation"] == 4
    assert g["nvlink"]["active_links"] == 18
    assert {p["kind"] for p in g["nvlink"]["peers"]} == {"switch"}
    assert sorted(p["links"] for p in g["nvlink"]["peers"]) == [4, 4, 5, 5]
    assert (
        g["power_limit_w"] == 700.0
        and g["temperature_c"] == 31
        and g["utilization"] == {"gpu": 0, "memory": 0}
    )
    assert g["ecc"]["volatile_uncorrected"] == 0 and g["mig"] == {"enabled": False, "pending": False}
    assert g["clock_event_reasons"] == ["gpu_idle"]
    # Hopper has row remapping, not page retirement: the field is missing, and says why.
    assert g["retired_pages"] is None and g["unavailable"]["retired_pages"] == "not supported"
    assert g["spec"]["name"].startswith("H100")
    nics = doc["node"]["nics"]
    assert len(nics) == 8
    assert all(n["rate_gbps"] == 400.0 and n["ports"][0]["transport"] == "InfiniBand" for n in nics)
    cpu = doc["node"]["cpu"]
    assert (cpu["sockets"], cpu["cores"], cpu["threads"]) == (2, 80, 160)
    assert cpu["isa_summary"]["amx"] and {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(cpu["isa"])
    assert [n["cpus"] for n in cpu["numa_nodes"]] == ["0-79", "80-159"]
    assert doc["node"]["driver"]["driver_version"] == "550.90.07"
    assert doc["node"]["driver"]["cuda_driver_version"] == "12.4"


def test_l40s_node_pcie_only(probe_fixture) -> None:
    doc = probe_fixture("l40s_pcie").to_dict()
    _assert_contract(doc)
    gpus = doc["node"]["accelerators"]
    assert [g["compute_capability"] for g in gpus] == ["8.9"] * 4
    assert all(g["nvlink"] is None and g["unavailable"]["nvlink"] == "not supported" for g in gpus)
    assert all(g["mig"] is None for g in gpus)
    assert [g["numa"] for g in gpus] == [0, 0, 1, 1]
    assert {n["ports"][0]["transport"] for n in doc["node"]["nics"]} == {"RoCE"}
    assert not doc["node"]["cpu"]["isa_summary"]["amx"]


def test_unsupported_fields_cost_only_themselves(probe_fixture) -> None:
    def strip(desc: dict) -> None:
        gpu = desc["nvml"]["gpus"][2]
        for key in ("power_draw_w", "temperature_c", "ecc", "pcie", "compute_capability", "cpu_affinity"):
            gpu[key] = None

    inv = probe_fixture("h100_hgx", strip)
    g = inv.to_dict()["node"]["accelerators"][2]
    assert g["power_w"] is None and g["temperature_c"] is None and g["ecc"] is None and g["pcie"] is None
    assert g["compute_capability"] is None
    assert {"power_w", "temperature_c", "ecc", "pcie", "compute_capability"} <= set(g["unavailable"])
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["memory_bytes"] is not None
    assert g["numa"] == 0  # still known from the PCI device's numa_node
    assert inv.accelerators[2].health.status == "pass"


def test_lost_gpu_is_listed_and_failed(probe_fixture) -> None:
    inv = probe_fixture("l40s_pcie", lambda d: d["nvml"]["gpus"][1].update(lost=True))
    lost = inv.accelerators[1]
    assert lost.health.status == "fail" and lost.health.reasons[0].code == "unreachable"
    assert inv.health == "fail"
    assert [a.health.status for a in inv.accelerators] == ["pass", "fail", "pass", "pass"]


def test_dead_nvml_gives_cpu_only_inventory(probe_fixture) -> None:
    inv = probe_fixture("l40s_pcie", lambda d: d["nvml"].update(unavailable="Driver Not Loaded"))
    doc = inv.to_dict()
    _assert_contract(doc)
    assert doc["node"]["accelerators"] == [] and doc["node"]["topology"]["devices"] == ["NIC0", "NIC1"]
    assert doc["node"]["driver"]["nvml"] is False and "Driver Not Loaded" in doc["node"]["driver"]["error"]
    assert doc["node"]["cpu"]["threads"] == 384


def test_gpu_less_machine_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "import pynvml" now raises ImportError
    assert open_nvml() == (None, "nvidia-ml-py is not installed")
    doc = probe_node(frameworks=False).to_dict()
    _assert_contract(doc)
    node = doc["node"]
    assert node["accelerators"] == [] and node["health"] == "pass"
    assert node["driver"]["error"] == "nvidia-ml-py is not installed"
    assert node["cpu"]["threads"] >= 1 and node["cpu"]["memory_bytes"] > 0
    assert node["cpu"]["usable_cpus"] == len(os.sched_getaffinity(0))


def test_gpu_less_machine_without_the_nvml_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    backend, reason = open_nvml()
    assert backend is None and reason is not None and "Library Not Found" in reason
    inv = probe_node(frameworks=False)
    assert inv.accelerators == () and inv.driver["nvml"] is False


def test_fake_rejects_missing_gpu_index() -> None:
    fake = FakeNvml({"nvml": {"gpus": []}})
    assert fake.device_count() == 0
    with pytest.raises(Exception, match="Invalid Argument"):
        fake.name(0)
