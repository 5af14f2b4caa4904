"""`gpuyard hw`: this node's CPUs, accelerators, topology, NICs and GPU health (rich tables or --json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

_STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _status(s: str) -> str:
    return f"[{_STATUS_STYLE.get(s, 'white')}]{s}[/]"


def _summary(console: Console, node: dict[str, Any]) -> None:
    cpu, drv = node["cpu"], node["driver"]
    isa = [k for k, v in cpu["isa_summary"].items() if v]
    numa = ", ".join(f"node{n['id']}: cpus {n['cpus']}" for n in cpu["numa_nodes"])
    console.print(f"[bold]{node['hostname']}[/bold]  health {_status(node['health'])}")
    console.print(
        f"  CPU     {cpu['model']} ({cpu['arch']}): {cpu['sockets']} socket(s), {cpu['cores']} cores, "
        f"{cpu['threads']} threads, {cpu['usable_cpus']} usable"
    )
    console.print(f"  memory  {_gib(cpu['memory_bytes'])}; NUMA {numa}")
    console.print(f"  ISA     {', '.join(isa) or 'none of note'}  ({' '.join(cpu['isa']) or '-'})")
    if drv.get("nvml"):
        console.print(f"  NVIDIA  driver {drv['driver_version']}, CUDA {drv['cuda_driver_version']}")
    else:
        console.print(f"  NVIDIA  no NVML ({drv.get('error') or 'not found'})")


def _devices(console: Console, accels: list[dict[str, Any]]) -> None:
    t = Table(title="accelerators", title_justify="left", box=box.SIMPLE_HEAD)
    for col in (
        "#",
        "name",
        "kind",
        "memory",
        "CC",
        "PCIe",
        "NUMA",
        "NVLink",
        "power",
        "temp",
        "util",
        "health",
    ):
        t.add_column(col)
    for a in accels:
        pcie = a.get("pcie")
        nvl = a.get("nvlink")
        power = a.get("power_w")
        limit = a.get("power_limit_w")
        util = a.get("utilization")
        t.add_row(
            str(a["index"]),
            a["name"].removeprefix("NVIDIA "),
            a["kind"],
            _gib(a["memory_bytes"]),
            _dash(a["compute_capability"]),
            f"Gen{pcie['gen']} x{pcie['width']}" if pcie else "-",
            _dash(a["numa"]),
            f"v{nvl['version']} x{nvl['active_links']}" if nvl else "-",
            f"{power:.0f}/{limit:.0f} W" if power is not None and limit is not None else "-",
            _dash(a.get("temperature_c"), "{} C"),
            f"{util['gpu']}%" if util else "-",
            _status(a["health"]),
        )
    console.print(t)


def _topology(console: Console, topo: dict[str, Any]) -> None:
    # Printed as plain aligned text, as nvidia-smi does: a 16-device matrix does not fit a boxed table.
    devices = topo["devices"]
    width = max(5, *(len(d) + 1 for d in devices))
    console.print("[bold]topology[/bold] (nvidia-smi topo -m vocabulary)")
    header = " " * 6 + "".join(f"{d:<{width}}" for d in devices) + "CPU Affinity    NUMA"
    lines = [header]
    for label, row in zip(devices, topo["matrix"], strict=True):
        numa = topo["numa_affinity"].get(label)
        cells = "".join(f"{c:<{width}}" for c in row)
        affinity = topo["cpu_affinity"].get(label, "")
        lines.append(f"{label:<6}{cells}{affinity:<16}{'' if numa is None else numa}")
    console.print("\n".join(line.rstrip() for line in lines), soft_wrap=True, highlight=False)
    if topo["nic_legend"]:
        console.print("  " + "  ".join(f"{k}: {v}" for k, v in topo["nic_legend"].items()), soft_wrap=True)
    console.print(
        "  X self, NV# bonded NVLinks, PIX one PCIe bridge, PXB several bridges, PHB host bridge, "
        "NODE across host bridges in a NUMA node, SYS across NUMA nodes",
        soft_wrap=True,
    )


def _nics(console: Console, nics: list[dict[str, Any]]) -> None:
    t = Table(title="RDMA NICs", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("name", "PCI", "NUMA", "port", "state", "rate", "transport", "netdevs"):
        t.add_column(col)
    for n in nics:
        for p in n["ports"]:
            t.add_row(
                n["name"],
                _dash(n["bus_id"]),
                _dash(n["numa"]),
                str(p["port"]),
                p["state"].split(":")[-1].strip(),
                p["rate"].replace("Gb/sec", "Gb/s"),
                p["transport"],
                ",".join(n["netdevs"]),
            )
    console.print(t)


def _health(console: Console, accels: list[dict[str, Any]]) -> None:
    t = Table(title="health", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("#", "status", "reasons"):
        t.add_column(col)
    for a in accels:
        reasons = "; ".join(f"{r['level']}: {r['message']}" for r in a.get("health_reasons") or []) or "-"
        t.add_row(str(a["index"]), _status(a["health"]), reasons)
    console.print(t)


def render(doc: dict[str, Any], console: Console) -> None:
    """Print a ``gpuyard hw --json`` document as tables."""
    node = doc["node"]
    _summary(console, node)
    accels = node["accelerators"]
    if accels:
        _devices(console, accels)
    else:
        console.print("  no accelerator found: CPU-only inventory")
    if node["topology"]["devices"]:
        _topology(console, node["topology"])
    if node["nics"]:
        _nics(console, node["nics"])
    if accels:
        _health(console, accels)


def hw(
    as_json: bool = typer.Option(False, "--json", help="Print the inventory as one JSON document."),
    no_record: bool = typer.Option(
        False, "--no-record", help="Do not record the inventory in the state store."
    ),
    frameworks: bool = typer.Option(
        False,
        "--frameworks",
        help="Also ask torch and JAX for accelerators (ROCm, MPS, TPU), even without a sign.",
    ),
    replay: Path | None = typer.Option(
        None,
        "--replay",
        help="Inventory a recorded node description (JSON, as in the test fixtures), not this machine; "
        "never recorded.",
        exists=True,
        dir_okay=False,
    ),
) -> None:
    """Inventory this node: CPU and ISA, GPUs (NVML), NVLink/PCIe topology, RDMA NICs, GPU health."""
    from gpuyard.hardware.probe import probe_node

    err = Console(stderr=True, highlight=False)
    if replay is not None:
        import tempfile

        from gpuyard.hardware.fake import FakeNvml, load_description, write_host_tree
        from gpuyard.hardware.sysfs import HostRoots

        desc = load_description(replay)
        with tempfile.TemporaryDirectory(prefix="gpuyard-replay-") as tmp:
            roots = HostRoots.under(write_host_tree(desc, Path(tmp)))
            inventory = probe_node(FakeNvml(desc), roots=roots, frameworks=False, hostname=replay.stem)
    else:
        inventory = probe_node(frameworks=True if frameworks else None)
        if not no_record:
            from gpuyard.errors import StoreError
            from gpuyard.hardware.record import record_inventory

            try:
                record_inventory(inventory)
            except StoreError as exc:
                # The inventory itself is good: print it, and say why it is not recorded.
                err.print(f"[yellow]warning:[/yellow] inventory not recorded: {exc}", soft_wrap=True)
    doc = inventory.to_dict()
    if as_json:
        typer.echo(json.dumps(doc))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured: no terminal to wrap for
    render(doc, console)


def register(app: typer.Typer) -> None:
    """Add `gpuyard hw` to the CLI."""
    app.command("hw")(hw)
