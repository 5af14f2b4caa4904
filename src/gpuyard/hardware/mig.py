"""MIG (Multi-Instance GPU) profiles of the A100 40GB, A100 80GB and H100 80GB.

Source: NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles"
(https://docs.nvidia.com/datacenter/tesla/mig-user-guide/#supported-mig-profiles), the tables
"GPU instance profiles on A100-SXM4-40GB", "... on A100-SXM4-80GB" and "... on H100-SXM5-80GB" (the
PCIe boards of the same memory size have the same profiles). A GPU has 7 compute slices and 8 memory
slices; a profile ``Ng.Mgb`` takes N compute slices and its share of the memory slices, and the GPU
holds at most ``max_count`` instances of it. The ``+me`` (media extension) variants are left out:
they differ only in owning the video decoders.

gpuyard only reads MIG: the slices a GPU has are the ones its administrator created
(``nvidia-smi mig -cgi ... -C``). Nothing here creates, destroys or reconfigures an instance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMPUTE_SLICES = 7
MEMORY_SLICES = 8


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile of one GPU model.

    Attributes:
        name: the profile, e.g. ``1g.10gb``.
        gpu: the GPU model, e.g. ``A100-80GB``.
        compute: compute slices (of 7).
        memory: memory slices (of 8).
        max_count: instances of this profile one GPU can hold.
    """

    name: str
    gpu: str
    compute: int
    memory: int
    max_count: int

    @property
    def memory_gb(self) -> int:
        """The nominal memory in the name (``1g.10gb`` -> 10)."""
        return int(self.name.split(".")[1].removesuffix("gb"))


# (GPU model, profile, compute slices, memory slices, max instances), from the user guide's tables.
_TABLE = [
    ("A100-40GB", "1g.5gb", 1, 1, 7),
    ("A100-40GB", "1g.10gb", 1, 2, 4),
    ("A100-40GB", "2g.10gb", 2, 2, 3),
    ("A100-40GB", "3g.20gb", 3, 4, 2),
    ("A100-40GB", "4g.20gb", 4, 4, 1),
    ("A100-40GB", "7g.40gb", 7, 8, 1),
    ("A100-80GB", "1g.10gb", 1, 1, 7),
    ("A100-80GB", "1g.20gb", 1, 2, 4),
    ("A100-80GB", "2g.20gb", 2, 2, 3),
    ("A100-80GB", "3g.40gb", 3, 4, 2),
    ("A100-80GB", "4g.40gb", 4, 4, 1),
    ("A100-80GB", "7g.80gb", 7, 8, 1),
    ("H100-80GB", "1g.10gb", 1, 1, 7),
    ("H100-80GB", "1g.20gb", 1, 2, 4),
    ("H100-80GB", "2g.20gb", 2, 2, 3),
    ("H100-80GB", "3g.40gb", 3, 4, 2),
    ("H100-80GB", "4g.40gb", 4, 4, 1),
    ("H100-80GB", "7g.80gb", 7, 8, 1),
]

PROFILES: dict[tuple[str, str], MigProfile] = {
    (gpu, name): MigProfile(name, gpu, c, m, n) for gpu, name, c, m, n in _TABLE
}
MIG_GPUS: tuple[str, ...] = tuple(dict.fromkeys(gpu for gpu, *_ in _TABLE))
PROFILE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(name for _, name, *_ in _TABLE))


def mig_model(gpu_name: str) -> str | None:
    """The MIG table's model of an NVML GPU name (``NVIDIA A100-SXM4-80GB`` -> ``A100-80GB``), or None
    for a GPU without MIG here (L40S, V100, ...)."""
    text = gpu_name.upper()
    for model in ("A100", "H100"):
        if model in text:
            size = re.search(r"(\d+)\s*GB", text)
            key = f"{model}-{size.group(1) if size else ''}GB"
            return key if key in MIG_GPUS else None
    return None


def profiles_of(model: str) -> list[MigProfile]:
    """The profiles of one GPU model, smallest first (empty for a model without MIG)."""
    return [p for (gpu, _), p in PROFILES.items() if gpu == model]


def check_layout(model: str, profiles: list[str]) -> None:
    """Refuse a set of instances that one GPU of ``model`` cannot hold (used by the fake hardware).

    Raises:
        ValueError: an unknown profile for the model, more instances than it allows, or more compute or
            memory slices than the GPU has (one line).
    """
    known = {p.name: p for p in profiles_of(model)}
    if not known:
        raise ValueError(f"{model} has no MIG profiles here; MIG GPUs: {', '.join(MIG_GPUS)}")
    compute = memory = 0
    for name in profiles:
        p = known.get(name)
        if p is None:
            raise ValueError(f"{name!r} is not a {model} MIG profile; known: {', '.join(known)}")
        if profiles.count(name) > p.max_count:
            raise ValueError(f"a {model} holds at most {p.max_count} {name} instances")
        compute, memory = compute + p.compute, memory + p.memory
    if compute > COMPUTE_SLICES or memory > MEMORY_SLICES:
        raise ValueError(
            f"{' + '.join(profiles)} takes {compute}/7 compute and {memory}/8 memory slices of a {model}"
        )


_MIG_NAME = re.compile(r"MIG\s+(\d+g\.\d+gb)", re.IGNORECASE)


def profile_from_name(device_name: str) -> str | None:
    """The profile in an NVML MIG device name (``NVIDIA A100-SXM4-40GB MIG 1g.5gb`` -> ``1g.5gb``)."""
    match = _MIG_NAME.search(device_name)
    return match.group(1).lower() if match else None


# Where a GPU instance may sit: the memory slices (of 8) it may start at, by (compute, memory) slices
# of its profile; it spans ``memory`` slices and no two instances of a GPU overlap. From the MIG user
# guide's ``nvidia-smi mig -lgipp`` listing ("Getting Started with MIG", "GPU Instances": profile IDs
# 19/15/14/9/5/0, ``{0,1,2,3,4,5,6}:1``, ``{0,2,4,6}:2``, ``{0,2,4}:2``, ``{0,4}:4``, ``{0}:4``,
# ``{0}:8``), the same on the A100 40GB, A100 80GB and H100 80GB.
_STARTS: dict[tuple[int, int], tuple[int, ...]] = {
    (1, 1): (0, 1, 2, 3, 4, 5, 6),
    (1, 2): (0, 2, 4, 6),
    (2, 2): (0, 2, 4),
    (3, 4): (0, 4),
    (4, 4): (0,),
    (7, 8): (0,),
}


def placements(profile: MigProfile) -> tuple[int, ...]:
    """The memory slices an instance of ``profile`` may start at (it spans ``profile.memory``)."""
    return _STARTS[(profile.compute, profile.memory)]


def arrange(model: str, instances: list[tuple[str, int | None]]) -> list[int]:
    """Start memory slices for one GPU's instances ``(profile, start or None)``, as the hardware
    allows them (:func:`placements`, no overlap); a given start is kept. The first arrangement found,
    largest instances first.

    Raises:
        ValueError: an unknown profile for the model, a start it may not take, or no arrangement
            (one line).
    """
    known = {p.name: p for p in profiles_of(model)}
    if not known:
        raise ValueError(f"{model} has no MIG profiles here; MIG GPUs: {', '.join(MIG_GPUS)}")
    for name, start in instances:
        p = known.get(name)
        if p is None:
            raise ValueError(f"{name!r} is not a {model} MIG profile; known: {', '.join(known)}")
        if start is not None and start not in placements(p):
            allowed = ",".join(map(str, placements(p)))
            raise ValueError(f"a {model} {name} starts at memory slice {{{allowed}}}, not {start}")
    check_layout(model, [name for name, _ in instances])  # counts and slices first: a plainer message
    order = sorted(
        range(len(instances)), key=lambda i: (instances[i][1] is None, -known[instances[i][0]].memory)
    )
    starts: list[int] = [-1] * len(instances)

    def fit(k: int, used: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        name, fixed = instances[i]
        p = known[name]
        for s in (fixed,) if fixed is not None else placements(p):
            span = ((1 << p.memory) - 1) << s
            if not used & span:
                starts[i] = s
                if fit(k + 1, used | span):
                    return True
        return False

    if not fit(0, 0):
        names = "+".join(n if s is None else f"{n}@{s}" for n, s in instances)
        raise ValueError(f"{names} cannot be placed on one {model}: instances overlap (MIG placements)")
    return starts
