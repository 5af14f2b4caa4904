"""Host CPU, memory and NUMA inventory from /proc/cpuinfo, /proc/meminfo and /sys/devices/system."""

from __future__ import annotations

import os
import platform
import re

from gpuyard.hardware.inventory import CpuInfo, NumaNode, parse_cpu_list
from gpuyard.hardware.sysfs import HostRoots, read_int, read_text

# Instruction-set extensions that matter to AI kernels (oneDNN, FBGEMM, llama.cpp, XNNPACK pick
# code paths from these). x86 names are the kernel's /proc/cpuinfo "flags"; ARM names its "Features".
AI_ISA_FLAGS = (
    # x86: AVX2/FMA baseline, the AVX-512 family, VNNI int8 dot products, BF16/FP16, AMX tiles.
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512cd",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx_vnni_int8",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    # ARM: NEON, dot product, half precision, SVE/SVE2, BF16, int8 matrix multiply, SME.
    "asimd",
    "asimddp",
    "asimdhp",
    "fphp",
    "sve",
    "sve2",
    "bf16",
    "svebf16",
    "i8mm",
    "svei8mm",
    "sme",
)


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = []
    for chunk in re.split(r"\n\s*\n", text):
        entry: dict[str, str] = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                entry[key.strip().lower()] = value.strip()
        if entry:
            blocks.append(entry)
    return blocks


def _model_and_vendor(blocks: list[dict[str, str]], arch: str) -> tuple[str, str]:
    for b in blocks:
        if "model name" in b:
            return b["model name"], b.get("vendor_id", "unknown")
    # ARM kernels print no model name: name the implementer/part so two machines can still be told apart.
    for b in blocks:
        if "cpu implementer" in b:
            impl = b["cpu implementer"]
            return f"{arch} (implementer {impl}, part {b.get('cpu part', '?')})", impl
    return platform.processor() or arch or "unknown", "unknown"


def _isa(blocks: list[dict[str, str]]) -> tuple[str, ...]:
    flags: set[str] = set()
    for b in blocks[:1]:  # every logical CPU repeats the same flags; the first is enough
        flags.update((b.get("flags") or b.get("features") or "").split())
    return tuple(f for f in AI_ISA_FLAGS if f in flags)


def _cores_and_sockets(roots: HostRoots, blocks: list[dict[str, str]], threads: int) -> tuple[int, int]:
    # The sysfs topology exists on x86 and ARM alike; /proc/cpuinfo only names packages and cores on x86.
    cpu_dir = roots.sys / "devices" / "system" / "cpu"
    pairs: set[tuple[int, int]] = set()
    for topo in sorted(cpu_dir.glob("cpu[0-9]*/topology")):
        pkg, core = read_int(topo / "physical_package_id"), read_int(topo / "core_id")
        if pkg is not None and core is not None:
            pairs.add((pkg, core))
    if pairs:
        return len(pairs), len({p for p, _ in pairs})
    x86 = {(b.get("physical id", "0"), b.get("core id", b.get("processor", "0"))) for b in blocks}
    if any("core id" in b for b in blocks):
        return len(x86), len({p for p, _ in x86})
    return max(1, threads), 1


def _meminfo_bytes(text: str | None, key: str = "MemTotal") -> int | None:
    if not text:
        return None
    m = re.search(rf"{key}:\s+(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else None


def _numa_nodes(roots: HostRoots) -> tuple[NumaNode, ...]:
    node_dir = roots.sys / "devices" / "system" / "node"
    nodes = []
    for d in node_dir.glob("node[0-9]*"):
        cpus = parse_cpu_list(read_text(d / "cpulist") or "")
        nodes.append(
            NumaNode(
                id=int(d.name[4:]), cpus=tuple(cpus), memory_bytes=_meminfo_bytes(read_text(d / "meminfo"))
            )
        )
    return tuple(sorted(nodes, key=lambda n: n.id))


def probe_cpu(roots: HostRoots | None = None) -> CpuInfo:
    """Describe the host CPUs, memory and NUMA layout.

    Args:
        roots: where /proc and /sys are (tests point them at a recorded tree).

    Returns:
        A :class:`CpuInfo`; fields the kernel does not expose fall back to psutil or to safe defaults
        (one socket, one NUMA node holding every CPU), never an exception.
    """
    roots = roots or HostRoots()
    blocks = _cpuinfo_blocks(read_text(roots.proc / "cpuinfo") or "")
    arch = platform.machine() if roots.live else _arch_from_flags(blocks)
    model, vendor = _model_and_vendor(blocks, arch)
    threads = sum(1 for b in blocks if "processor" in b) or (os.cpu_count() or 1)
    cores, sockets = _cores_and_sockets(roots, blocks, threads)
    usable = len(os.sched_getaffinity(0)) if roots.live and hasattr(os, "sched_getaffinity") else threads
    memory = _meminfo_bytes(read_text(roots.proc / "meminfo"))
    if memory is None and roots.live:
        import psutil

        memory = int(psutil.virtual_memory().total)
    numa = _numa_nodes(roots) or (NumaNode(0, tuple(range(threads)), memory),)
    return CpuInfo(
        model=model,
        vendor=vendor,
        arch=arch,
        sockets=sockets,
        cores=cores,
        threads=threads,
        usable_cpus=usable,
        memory_bytes=memory or 0,
        isa=_isa(blocks),
        numa_nodes=numa,
    )


def _arch_from_flags(blocks: list[dict[str, str]]) -> str:
    # A recorded tree does not say which machine it came from; its cpuinfo keys do.
    if blocks and "cpu implementer" in blocks[0]:
        return "aarch64"
    return "x86_64" if blocks and "flags" in blocks[0] else "unknown"


def numa_of_cpus(cpus: list[int] | tuple[int, ...], nodes: tuple[NumaNode, ...]) -> int | None:
    """The NUMA node holding most of ``cpus`` (a GPU's CPU affinity), or None when there is no overlap."""
    best, best_overlap = None, 0
    wanted = set(cpus)
    for node in nodes:
        overlap = len(wanted & set(node.cpus))
        if overlap > best_overlap:
            best, best_overlap = node.id, overlap
    return best
