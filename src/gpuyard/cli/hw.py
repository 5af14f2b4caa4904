"""`gpuyard hw`: this node's CPUs, accelerators, topology, NICs and GPU health (rich tables or --json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
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
    console.print(f"[bold]{escape(str(node['hostname']))}[/bold]  health {_status(node['health'])}")
    console.print(
        f"  CPU     {cpu['model']} ({cpu['arch']}): {cpu['sockets']} socket(s), {cpu['cores']} cores, "
        f"{cpu['threads']} threads, {cpu['usable_cpus']} usable"
    )
    console.print(f"  memory  {_gib(cpu['memory_bytes'])}; NUMA {numa}")
    console.print(f"  ISA     {', '.join(isa) or 'none of note'}  ({' '.join(cpu['isa']) or '-'})")
    if drv.get("nvml"):
        console.print(f"  NVIDIA  driver {drv['driver_version']}, CUDA {drv['cuda_driver_version']}")
    else:
        console.print(f"  NVIDIA  no NVML ({escape(str(drv.get('error') or 'not found'))})")


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
        "MIG",
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
            _mig_text(a.get("mig")),
            _status(a["health"]),
        )
    console.print(t)


def _mig_text(mig: dict[str, Any] | None) -> str:
    """``-`` (not reported), ``off``, ``on: 3g.40gb x2`` (its slices), ``off -> on`` (pending reset)."""
    if not mig:
        return "-"
    state = "on" if mig.get("enabled") else "off"
    if mig.get("pending") != mig.get("enabled"):
        state += f" -> {'on' if mig.get('pending') else 'off'}"
    counts: dict[str, int] = {}
    for d in mig.get("devices") or []:
        counts[str(d.get("profile"))] = counts.get(str(d.get("profile")), 0) + 1
    slices = ", ".join(f"{p} x{n}" for p, n in counts.items())
    return f"{state}: {slices}" if slices else state


def _mig_slices(console: Console, accels: list[dict[str, Any]]) -> None:
    t = Table(title="MIG slices", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("GPU", "#", "profile", "memory", "UUID (CUDA_VISIBLE_DEVICES)"):
        t.add_column(col)
    for a in accels:
        for d in (a.get("mig") or {}).get("devices") or []:
            t.add_row(
                str(a["index"]), str(d["index"]), str(d["profile"]), _gib(d.get("memory_bytes")), d["uuid"]
            )
    console.print(t)


def gpu_use_rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    """Per GPU (and per MIG slice) of the scheduler's nodes, what holds it: the ``/cluster/scheduler``
    document (nodes and active jobs) as rows ``{node, gpu, kind, use, jobs}``.

    ``kind``: ``whole``, ``shared``, ``MIG <profile>``, ``unhealthy`` or ``free``.
    """
    whole: dict[tuple[str, int], list[str]] = {}
    shares: dict[tuple[str, int], list[tuple[str, float, float]]] = {}
    slices: dict[str, str] = {}
    for job in sorted(view.get("active") or [], key=lambda j: int(j["id"])):
        label = f"{job['id']} {job['name']}"
        for part in (job.get("placement") or {}).get("nodes", []):
            if part.get("mig"):
                slices.update({str(m["uuid"]): label for m in part["mig"]})
            elif part.get("share"):
                sh = part["share"]
                for g in part.get("gpus") or []:
                    shares.setdefault((part["node"], g), []).append(
                        (label, float(sh["fraction"]), float(sh.get("memory_gb") or 0.0))
                    )
            else:
                for g in part.get("gpus") or []:
                    whole.setdefault((part["node"], g), []).append(label)
    rows: list[dict[str, Any]] = []
    for n in view.get("nodes") or []:
        name, memory = n["name"], float(n.get("gpu_memory_gb") or 0.0)
        mig = n.get("mig") or []
        mig_gpus = set(n.get("mig_mode") or []) | {int(m["gpu"]) for m in mig}
        for g in range(int(n["gpus"])):
            row = {"node": name, "gpu": g}
            if g in set(n.get("excluded") or []):
                rows.append({**row, "kind": "unhealthy", "use": "failed its health check", "jobs": []})
            elif g in mig_gpus:
                mine = [m for m in mig if int(m["gpu"]) == g]
                if not mine:
                    rows.append({**row, "kind": "MIG", "use": "MIG mode, no slices", "jobs": []})
                for m in mine:
                    holder = slices.get(str(m["uuid"]))
                    use = f"{m['uuid']} {'held' if holder else 'free'}"
                    rows.append(
                        {**row, "kind": f"MIG {m['profile']}", "use": use, "jobs": [holder] if holder else []}
                    )
            elif (name, g) in whole:
                rows.append({**row, "kind": "whole", "use": "whole GPU", "jobs": whole[(name, g)]})
            elif (name, g) in shares:
                held = shares[(name, g)]
                fraction, gb = sum(h[1] for h in held), sum(h[2] for h in held)
                of = f"/{memory:.0f}" if memory else ""
                use = f"{fraction:.2g}/1.0 of compute, {gb:.0f}{of} GB"
                jobs = [f"{h[0]} ({h[1]:.2g})" for h in held]
                rows.append({**row, "kind": "shared", "use": use, "jobs": jobs})
            else:
                rows.append({**row, "kind": "free", "use": "", "jobs": []})
    return rows


def _gpu_use(console: Console, rows: list[dict[str, Any]]) -> None:
    t = Table(title="GPU use (the scheduler's jobs)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("node", "GPU", "kind", "use", "jobs"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["node"], str(r["gpu"]), r["kind"], r["use"], "; ".join(r["jobs"]))
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
        if any((a.get("mig") or {}).get("devices") for a in accels):
            _mig_slices(console, accels)
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
    jobs: bool = typer.Option(
        False,
        "--jobs",
        help="Instead of the inventory: what holds each GPU and MIG slice of the server's nodes "
        "(whole, shares, slices, free).",
    ),
    server: str | None = typer.Option(
        None, "--server", help="With --jobs: server URL (default: GPUYARD_SERVER or http://127.0.0.1:8765)."
    ),
) -> None:
    """Inventory this node: CPU and ISA, GPUs (NVML), NVLink/PCIe topology, RDMA NICs, GPU health."""
    from gpuyard.hardware.probe import probe_node

    err = Console(stderr=True, highlight=False)
    if jobs:
        from gpuyard.scheduler.client import JobClient
        from gpuyard.settings import load_settings

        client = JobClient(server or load_settings().server_url)
        try:
            rows = gpu_use_rows(client.scheduler_view())
        finally:
            client.close()
        if as_json:
            typer.echo(json.dumps(rows))
        else:
            _gpu_use(Console(width=160) if not Console().is_terminal else Console(), rows)
        return
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
                why = escape(str(exc))
                err.print(f"[yellow]warning:[/yellow] inventory not recorded: {why}", soft_wrap=True)
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
