"""Accelerators only a framework reports: AMD GPUs (ROCm) and Apple MPS through torch, TPUs through JAX.

Importing torch costs about a second and JAX more, so each is imported only when a cheap sign says
it can find something: ``/dev/kfd`` (the ROCm kernel driver) or macOS for torch, ``/dev/accel*`` /
``/dev/vfio`` or the ``TPU_*`` variables of a TPU VM for JAX. ``force=True`` skips the signs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import platform
from typing import Any

from gpuyard.hardware.inventory import Accelerator
from gpuyard.hardware.nvidia import _spec
from gpuyard.hardware.sysfs import HostRoots

_NO_HEALTH = "no health counters through torch/jax"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def rocm_or_mps_possible(roots: HostRoots) -> bool:
    """True when torch could find a ROCm GPU (``/dev/kfd``) or MPS (macOS on Apple silicon)."""
    if (roots.dev / "kfd").exists():
        return True
    return roots.live and platform.system() == "Darwin" and platform.machine() == "arm64"


def tpu_possible(roots: HostRoots) -> bool:
    """True when JAX could find TPU chips (device nodes or TPU VM environment variables)."""
    if any(roots.dev.glob("accel[0-9]*")) or any(roots.dev.glob("vfio/[0-9]*")):
        return True
    return roots.live and any(k in os.environ for k in ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_ID"))


def torch_accelerators(torch: Any) -> list[Accelerator]:
    """GPUs torch sees: ROCm (``torch.version.hip``), CUDA NVML could not list, or one MPS device."""
    out: list[Accelerator] = []
    hip = getattr(torch.version, "hip", None)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            uuid = getattr(props, "uuid", None)
            if hip:
                cc = getattr(props, "gcnArchName", None)
            else:
                cc = f"{props.major}.{props.minor}"
            out.append(
                Accelerator(
                    index=i,
                    kind="rocm" if hip else "cuda",
                    vendor="amd" if hip else "nvidia",
                    name=str(props.name),
                    uuid=str(uuid) if uuid is not None else None,
                    memory_bytes=int(props.total_memory),
                    compute_capability=cc,
                    spec=_spec(str(props.name)),
                    source="torch",
                    unavailable={"health": _NO_HEALTH},
                )
            )
        return out
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    if mps is not None and mps.is_available():
        memory = None
        recommended = getattr(getattr(torch, "mps", None), "recommended_max_memory", None)
        if recommended is not None:
            memory = int(recommended())
        out.append(
            Accelerator(
                index=0,
                kind="mps",
                vendor="apple",
                name=f"Apple MPS ({platform.machine()})",
                uuid=None,
                memory_bytes=memory,
                compute_capability=None,
                source="torch",
                unavailable={"health": _NO_HEALTH},
            )
        )
    return out


def jax_tpus(jax: Any) -> list[Accelerator]:
    """TPU chips JAX sees (``jax.devices("tpu")``); none when JAX has no TPU backend."""
    try:
        devices = jax.devices("tpu")
    except RuntimeError:  # "Unknown backend tpu" / no TPU found
        return []
    out = []
    for n, d in enumerate(devices):
        memory = None
        try:
            stats = d.memory_stats() or {}
            memory = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
        except Exception:  # memory_stats is optional per backend; a missing figure is not an error
            memory = None
        kind_name = str(getattr(d, "device_kind", "TPU"))
        coords = getattr(d, "coords", None)
        out.append(
            Accelerator(
                index=n,
                kind="tpu",
                vendor="google",
                name=kind_name,
                uuid=None,
                memory_bytes=memory,
                compute_capability=None,
                telemetry={"tpu_id": int(getattr(d, "id", n)), "coords": list(coords) if coords else None},
                spec=_spec(kind_name),
                source="jax",
                unavailable={"health": _NO_HEALTH},
            )
        )
    return out


def framework_accelerators(roots: HostRoots, *, force: bool = False) -> tuple[list[Accelerator], list[str]]:
    """Accelerators found through torch and JAX, and notes on what was looked at.

    Args:
        roots: the kernel file systems, for the cheap signs.
        force: import torch / JAX even without a sign (``gpuyard hw --frameworks``).
    """
    found: list[Accelerator] = []
    notes: list[str] = []
    if _installed("torch") and (force or rocm_or_mps_possible(roots)):
        found.extend(torch_accelerators(importlib.import_module("torch")))
        notes.append("torch")
    if _installed("jax") and (force or tpu_possible(roots)):
        tpus = jax_tpus(importlib.import_module("jax"))
        found.extend(_reindex(tpus, start=len(found)))
        notes.append("jax")
    return found, notes


def _reindex(accels: list[Accelerator], start: int) -> list[Accelerator]:
    # Indexes stay unique when torch and JAX both report devices.
    return [dataclasses.replace(a, index=start + k) for k, a in enumerate(accels)]
