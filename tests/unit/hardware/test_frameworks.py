"""Accelerators reported through torch (ROCm, MPS) and JAX (TPU), and when they are asked at all."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpuyard.hardware import frameworks
from gpuyard.hardware.fake import FakeNvml
from gpuyard.hardware.frameworks import framework_accelerators, jax_tpus, torch_accelerators
from gpuyard.hardware.probe import probe_node
from gpuyard.hardware.sysfs import HostRoots

pytestmark = pytest.mark.unit
ns = types.SimpleNamespace


def fake_torch(hip: str | None = "6.2.41133", gpus: int = 2, mps: bool = False) -> Any:
    props = ns(
        name="AMD Instinct MI300X",
        total_memory=205822885888,
        gcnArchName="gfx942:sramecc+:xnack-",
        major=9,
        minor=4,
        uuid="58ff7b13-0000-1000-8002-8a5b7ab3a3c9",
    )
    return ns(
        version=ns(hip=hip),
        cuda=ns(
            is_available=lambda: gpus > 0, device_count=lambda: gpus, get_device_properties=lambda i: props
        ),
        backends=ns(mps=ns(is_available=lambda: mps)),
        mps=ns(recommended_max_memory=lambda: 48 * 2**30),
    )


def test_rocm_gpus_through_torch() -> None:
    accels = torch_accelerators(fake_torch())
    assert [a.kind for a in accels] == ["rocm", "rocm"] and accels[0].vendor == "amd"
    assert accels[1].index == 1 and accels[0].compute_capability.startswith("gfx942")
    assert accels[0].memory_bytes == 205822885888 and accels[0].source == "torch"
    assert accels[0].spec is not None and accels[0].spec["name"].startswith("MI300X")
    assert accels[0].to_dict()["unavailable"]["health"]


def test_mps_through_torch() -> None:
    accels = torch_accelerators(fake_torch(hip=None, gpus=0, mps=True))
    assert len(accels) == 1 and accels[0].kind == "mps" and accels[0].memory_bytes == 48 * 2**30


def test_tpus_through_jax() -> None:
    class Dev:
        def __init__(self, i: int) -> None:
            self.id, self.device_kind, self.coords = i, "TPU v5 lite", (i, 0, 0)

        def memory_stats(self) -> dict[str, int]:
            return {"bytes_limit": 16 * 2**30}

    jax = ns(devices=lambda backend: [Dev(i) for i in range(4)])
    tpus = jax_tpus(jax)
    assert [t.kind for t in tpus] == ["tpu"] * 4 and tpus[3].to_dict()["coords"] == [3, 0, 0]
    assert tpus[0].memory_bytes == 16 * 2**30 and tpus[0].spec["name"] == "TPU-v5e"

    def no_tpu(backend: str) -> list:
        raise RuntimeError(
            "Unknown backend: 'tpu' requested, but no platforms that are instances of tpu are present"
        )

    assert jax_tpus(ns(devices=no_tpu)) == []


def test_no_sign_means_no_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    monkeypatch.setattr(frameworks.importlib, "import_module", lambda name: imported.append(name))
    found, looked = framework_accelerators(HostRoots.under(tmp_path))
    assert (found, looked, imported) == ([], [], [])


def test_dev_kfd_makes_probe_ask_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").touch()
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.setattr(frameworks, "_installed", lambda module: module == "torch")
    no_gpu = FakeNvml({"nvml": {"gpus": [], "driver_version": "-", "cuda_driver_version": 0}})
    inv = probe_node(no_gpu, roots=HostRoots.under(tmp_path))
    assert [a.kind for a in inv.accelerators] == ["rocm", "rocm"]
    assert inv.driver["frameworks"] == ["torch"]
    assert inv.topology.devices == ("GPU0", "GPU1")
    # With NVML GPUs present, torch is not consulted unless asked.
    assert probe_node(no_gpu, roots=HostRoots.under(tmp_path), frameworks=False).accelerators == ()
