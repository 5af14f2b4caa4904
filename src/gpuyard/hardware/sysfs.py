"""Where the probe reads the kernel's view of the machine (/proc, /sys, /dev), injectable for tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostRoots:
    """Roots of the kernel file systems the probe reads.

    Attributes:
        proc: usually ``/proc`` (cpuinfo, meminfo).
        sys: usually ``/sys`` (NUMA nodes, CPU topology, PCI devices, InfiniBand class).
        dev: usually ``/dev`` (``/dev/kfd`` tells a ROCm machine, ``/dev/accel*`` a TPU VM).
        live: True when these are this machine's own file systems, so process-level facts
            (``os.sched_getaffinity``) describe the same host.
    """

    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    dev: Path = Path("/dev")
    live: bool = True

    @classmethod
    def under(cls, root: Path) -> HostRoots:
        """Roots inside a recorded tree ``root/{proc,sys,dev}`` (fixtures); not live."""
        return cls(proc=root / "proc", sys=root / "sys", dev=root / "dev", live=False)


def read_text(path: Path) -> str | None:
    """The stripped content of a small kernel file, or None when it is missing or unreadable."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path) -> int | None:
    """A kernel file holding one integer (decimal or 0x-hex), or None."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def pci_chain(device_dir: Path, sys_root: Path) -> tuple[str, ...] | None:
    """The PCI path of a sysfs device, from its host bridge down to itself.

    ``/sys/bus/pci/devices/0000:18:00.0`` links to
    ``/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0``; the chain is
    ``("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")``: the host
    bridge, then every bridge and switch port on the way, then the device. None when the path does
    not resolve under ``sys_root/devices`` (no sysfs, a virtual device).
    """
    try:
        real = device_dir.resolve(strict=True)
        rel = real.relative_to((sys_root / "devices").resolve())
    except (OSError, ValueError):
        return None
    parts = rel.parts
    start = next((k for k, p in enumerate(parts) if p.startswith("pci")), None)
    if start is None:
        return None
    # Stop at the last PCI address (a NIC's ``device`` link may point at a function; nothing follows).
    chain = [parts[start]] + [p for p in parts[start + 1 :] if _is_bdf(p)]
    return tuple(chain)


def _is_bdf(part: str) -> bool:
    # 0000:18:00.0 -> domain:bus:device.function
    pieces = part.split(":")
    return len(pieces) == 3 and "." in pieces[2]


def pci_device_dir(bus_id: str, sys_root: Path) -> Path:
    """``sys_root/bus/pci/devices/<bus_id>`` (bus id in sysfs form, ``0000:18:00.0``)."""
    return sys_root / "bus" / "pci" / "devices" / bus_id
