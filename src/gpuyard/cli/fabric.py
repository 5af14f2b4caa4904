"""`gpuyard fabric ...`: cluster presets, the collective cost model and measured collectives."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape

fabric_app = typer.Typer(help="The fabric between GPUs: clusters, collective model, measured collectives.")


@fabric_app.command("clusters")
def clusters(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the cluster presets (files in gpuyard/fabric/presets plus `local`)."""
    from rich.console import Console
    from rich.table import Table

    from gpuyard.fabric.presets import list_presets, load_cluster

    rows = []
    for name in list_presets():
        if name == "local":
            rows.append({"name": "local", "description": "this machine, from `gpuyard hw`"})
        else:
            rows.append({"name": name, "description": load_cluster(name).description})
    if as_json:
        typer.echo(json.dumps({"clusters": rows}))
        return
    table = Table("preset", "description")
    for row in rows:
        table.add_row(row["name"], row["description"])
    Console().print(table)


@fabric_app.command("accelerators")
def accelerators(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the accelerator catalog: dense peaks, memory, links, and the datasheets they come from."""
    from rich.console import Console
    from rich.table import Table

    from gpuyard.hardware.catalog import list_specs

    specs = list_specs()
    if as_json:
        typer.echo(json.dumps({"accelerators": [s.to_dict() for s in specs]}))
        return
    table = Table(
        "name", "memory GB", "HBM GB/s", "fp32", "tf32", "bf16", "fp8", "link GB/s (bidir)", "TDP W"
    )
    for s in specs:
        cells = [s.fp32_tflops, s.tf32_tflops, s.bf16_tflops, s.fp8_tflops]
        table.add_row(
            s.name,
            f"{s.memory_bytes / 1e9:g}",
            f"{s.memory_bw_GBps:g}",
            *("-" if c is None else f"{c:g}" for c in cells),
            f"{s.interconnect_GBps:g} {s.interconnect or ''}".strip(),
            f"{s.tdp_w or '-'}",
        )
    Console(width=max(Console().width, 110)).print(table)
    typer.echo("Dense TFLOP/s. Sources: gpuyard/hardware/catalog.py (SOURCES).")


@fabric_app.command("show")
def show(
    cluster: str = typer.Argument(..., help="Preset name or YAML/JSON cluster file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a cluster description (the same YAML a cluster file holds)."""
    import yaml

    from gpuyard.fabric.presets import load_cluster

    data = load_cluster(cluster).model_dump(mode="json", exclude_none=True)
    typer.echo(json.dumps(data) if as_json else yaml.safe_dump(data, sort_keys=False).rstrip())


@fabric_app.command("collective")
def collective(
    cluster: str = typer.Option(..., "--cluster", help="Preset name or cluster file."),
    gpus: int = typer.Option(..., "--gpus", help="Ranks taking part (whole nodes beyond one node)."),
    op: str = typer.Option(
        "all_reduce", "--op", help="all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv."
    ),
    size: str = typer.Option("1GiB", "--size", help="Message size (nccl-tests convention), e.g. 64MiB."),
    algorithm: str = typer.Option(None, "--algorithm", help="Force ring, tree, hierarchical, nvls, direct."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Model one collective: time, algbw and busbw as nccl-tests would report them."""
    from gpuyard.fabric.collectives import estimate
    from gpuyard.fabric.presets import load_cluster
    from gpuyard.fabric.units import format_size, parse_size

    est = estimate(load_cluster(cluster), op, gpus, parse_size(size), algorithm)
    if as_json:
        typer.echo(json.dumps(est.to_dict()))
        return
    typer.echo(
        f"{est.op} of {format_size(est.size_bytes)} on {est.gpus} GPUs of {cluster}: "
        f"{est.algorithm}/{est.protocol}, {est.time_s * 1e6:.1f} us, "
        f"algbw {est.algbw_GBps:.1f} GB/s, busbw {est.busbw_GBps:.1f} GB/s"
    )


@fabric_app.command("bench")
def bench(
    nproc: int = typer.Option(2, "--nproc", help="Ranks to spawn on this host (ignored under torchrun)."),
    ops: str = typer.Option(
        "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv",
        "--ops",
        help="Comma-separated ops.",
    ),
    sizes: str = typer.Option(
        "1KiB:64MiB", "--sizes", help="A size or MIN:MAX, doubling (nccl-tests -b/-e -f 2)."
    ),
    iters: int = typer.Option(
        10, "--iters", help="Timed iterations per size (fewer when one takes > 0.5 s)."
    ),
    warmup: int = typer.Option(2, "--warmup", help="Untimed iterations per size."),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl with CUDA, else gloo), nccl or gloo."),
    calibrate: Path = typer.Option(
        None, "--calibrate", help="Fit latency and bandwidth; write a cluster file."
    ),
    cluster: str = typer.Option("local", "--cluster", help="Cluster the calibration starts from."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Measure collectives across processes with torch.distributed, nccl-tests style; check every result."""
    from gpuyard.fabric.bench import BenchConfig, calibrated_cluster, run_bench
    from gpuyard.fabric.presets import load_cluster, save_cluster
    from gpuyard.fabric.units import parse_size_range

    cfg = BenchConfig(
        nproc=nproc,
        ops=tuple(o.strip() for o in ops.split(",") if o.strip()),
        sizes=tuple(parse_size_range(sizes)),
        warmup=warmup,
        iters=iters,
        backend=backend,
    )
    base = load_cluster(cluster) if calibrate else None
    result = run_bench(cfg)
    if result.rank != 0:
        return
    doc = result.to_dict()
    if calibrate and base is not None:
        fitted = calibrated_cluster(base, result)
        save_cluster(fitted, calibrate)
        doc["calibration"] = {
            "file": str(calibrate),
            "intra": fitted.intra.model_dump(),
            "nic": fitted.nic.model_dump(),
        }
    if as_json:
        typer.echo(json.dumps(doc))
        return
    _print_bench(result, calibrate)


@fabric_app.command("calibrate")
def calibrate(
    out: Path = typer.Option(Path("calibration.json"), "--out", help="Calibration file to write (JSON)."),
    nproc: int = typer.Option(
        None, "--nproc", help="Ranks measured at once (default: every GPU, or 2 CPU ranks)."
    ),
    backend: str = typer.Option("auto", "--backend", help="auto (nccl with CUDA, else gloo), nccl or gloo."),
    cluster: str = typer.Option("local", "--cluster", help="Cluster the calibration is checked against."),
    quick: bool = typer.Option(
        False, "--quick", help="Fewer shapes and sizes (a smoke test, not a calibration)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration as JSON."),
) -> None:
    """Measure this machine (GEMMs, attention, memory, dispatch, overlap, collectives); write a calibration.

    `gpuyard plan`, `gpuyard sim` and `gpuyard server` take the file with --calibration FILE.
    """
    from gpuyard.fabric.calibrate import (
        CalibrateConfig,
        apply_calibration,
        check_writable,
        run_calibration,
        save_calibration,
    )
    from gpuyard.fabric.presets import load_cluster

    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    base = load_cluster(cluster)
    check_writable(out)  # before minutes of measuring, not after
    cal = run_calibration(CalibrateConfig(nproc=nproc, backend=backend, quick=quick))
    fitted = apply_calibration(base, cal, where="the measurement of this machine")
    save_calibration(cal, out)
    if as_json:
        typer.echo(cal.model_dump_json())
        return
    dtype = "float32" if cal.device_kind == "cpu" else "bfloat16"
    precision = "fp32" if cal.device_kind == "cpu" else "bf16"
    fit = cal.gemm_fit[dtype]
    lines = [
        f"{cal.ranks} rank(s) of {cal.device_name} ({cal.threads_per_rank} thread(s) each), measured at once",
        f"GEMM {dtype}: {fit.peak_tflops:.3f} TFLOP/s for large shapes "
        f"({fitted.compute.gemm_efficiency:.0%} of the {fitted.peak_for(precision):.2f} TFLOP/s peak); "
        f"half of it at M {fit.half_m:.0f}, N {fit.half_n:.0f}, K {fit.half_k:.0f} "
        f"(fit error median {fit.median_error:.0%}, worst {fit.max_error:.0%})",
        f"attention {cal.attention_tflops:.3f} TFLOP/s "
        f"({cal.attention_efficiency:.0%} of the GEMM asymptote)",
        f"memory {cal.memory_bw_GBps:.1f} GB/s per rank (norm/GELU/dropout/add {cal.elementwise_GBps:.1f}); "
        f"dispatch {cal.op_overhead_us:.1f} us per kernel",
    ]
    if cal.h2d_GBps:
        lines.append(f"host->device {cal.h2d_GBps:.1f} GB/s, device->host {cal.d2h_GBps:.1f} GB/s (pinned)")
    if cal.overlap_slowdown is not None:
        lines.append(f"hidden communication still costs {cal.overlap_slowdown:.0%} of its time in compute")
    if cal.memory_reserved_bytes is not None and cal.memory_fragmentation is not None:
        lines.append(
            f"device memory: {cal.memory_reserved_bytes / 2**30:.2f} GiB held outside the caching allocator "
            f"(context, cuBLAS, NCCL); allocator peak reserved / allocated {cal.memory_fragmentation:.3f}"
            + (
                "; one rank: no NCCL communicator ran, so its buffers are not in the reserve"
                if cal.ranks == 1
                else ""
            )
        )
    for op, link in cal.links.items():
        lines.append(f"{op}: hop {link.hop_us:.1f} us, {link.bw_GBps:.2f} GB/s ({cal.backend})")
    lines.append(f"written to {out}; use it with --calibration {out}")
    typer.echo("\n".join(lines))


def _print_bench(result: object, calibrate: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from gpuyard.fabric.bench import BenchResult
    from gpuyard.fabric.units import format_size

    assert isinstance(result, BenchResult)  # narrowing for mypy: run_bench returns one
    table = Table(
        title=f"{result.backend}, {result.world_size} ranks (float32, out-of-place except all_reduce)"
    )
    for col in ("op", "size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "iters", "correct"):
        table.add_column(col, justify="right")
    for r in result.rows:
        table.add_row(
            r.op,
            format_size(r.size_bytes),
            str(r.count),
            f"{r.time_s * 1e6:.1f}",
            f"{r.algbw_GBps:.3f}",
            f"{r.busbw_GBps:.3f}",
            str(r.iters),
            "yes" if r.correct else "NO",
        )
    console = Console(width=max(Console().width, 100))
    console.print(table)
    wrong = [r for r in result.rows if not r.correct]
    console.print(f"{len(result.rows) - len(wrong)} of {len(result.rows)} results correct")
    if calibrate:
        console.print(f"calibrated cluster written to {escape(str(calibrate))}")


@fabric_app.command("topology")
def topology(
    cluster: str = typer.Argument(..., help="A cluster preset or file (its network's leaf and spine sizes)."),
    nodes: str = typer.Option(
        None, "--nodes", help="The nodes, in rack order, as a Slurm host list (gpu[001-064])."
    ),
    count: int = typer.Option(
        None, "--count", min=1, max=1_000_000, help="Without --nodes: this many nodes named CLUSTER-0000..."
    ),
    read: Path = typer.Option(
        None, "--read", help="Read a Slurm topology.conf instead: the cluster with its sizes from the tree."
    ),
    out: Path = typer.Option(None, "--out", help="With --read: write the cluster file here (else print it)."),
) -> None:
    """Slurm's topology.conf (topology/tree) from a cluster description, or (--read) the reverse."""
    import yaml

    from gpuyard.errors import ConfigError
    from gpuyard.fabric.presets import load_cluster, save_cluster
    from gpuyard.fabric.slurm_topology import (
        cluster_from_topology,
        hostlist_expand,
        parse_topology,
        topology_for,
    )

    model = load_cluster(cluster)
    if read is not None:
        if nodes or count:
            raise ConfigError("--read takes the nodes from topology.conf; leave out --nodes/--count")
        try:
            text = read.read_text()
        except OSError as exc:
            raise ConfigError(f"--read {read}: {exc.strerror}") from None
        updated = cluster_from_topology(model, parse_topology(text))
        if out is not None:
            save_cluster(updated, out)
            typer.echo(
                f"cluster {updated.name} ({updated.nodes} nodes, leaf_size {updated.network.leaf_size}) "
                f"written to {out}"
            )
        else:
            typer.echo(
                yaml.safe_dump(updated.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
            )
        return
    if nodes and count:
        raise ConfigError("give --nodes or --count, not both")
    names = hostlist_expand(nodes) if nodes else None
    if names is None:
        total = count or model.nodes
        if not total:
            raise ConfigError(f"cluster {model.name!r} does not fix its node count; give --count or --nodes")
        names = [f"{model.name}-{i:04d}" for i in range(total)]
    typer.echo(topology_for(model, names).to_conf(), nl=False)


@fabric_app.command("storage-bench")
def storage_bench(
    target: str = typer.Argument(..., help="A folder on the tier to measure (a path or a file:// URL)."),
    size: str = typer.Option("512MiB", "--size", help="File written and read back (1 MiB to 64 GiB)."),
    block: str = typer.Option("4MiB", "--block", help="Sequential write and read size (4 KiB to 64 MiB)."),
    max_seconds: float = typer.Option(
        60.0, "--max-seconds", help="Time budget; a phase past its share is cut short and said so (1-600)."
    ),
    name: str = typer.Option(None, "--name", help="Name of the tier (default: the folder's name)."),
    kind: str = typer.Option(
        None, "--kind", help="local-nvme, parallel-fs or object-store (default: from the file system type)."
    ),
    out: Path = typer.Option(None, "--out", help="Write the tier as a file for gpuyard plan --storage."),
    calibration: Path = typer.Option(
        None, "--calibration", help="Add the tier to this calibration file (from gpuyard fabric calibrate)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the measurement as JSON."),
) -> None:
    """Measure a storage tier: sequential write (fsync included) and read, random 4 KiB reads, fsync.

    It writes only inside a private folder it creates in TARGET and removes it again, even when stopped.
    `gpuyard plan --storage` takes the result from --out FILE or from --calibration FILE.
    """
    from gpuyard.errors import ConfigError
    from gpuyard.fabric.calibrate import add_storage, check_writable
    from gpuyard.fabric.storage_bench import (
        BenchConfig,
        Kind,
        guess_kind,
        resolve_target,
        run_storage_bench,
    )
    from gpuyard.fabric.units import parse_size

    cfg = BenchConfig(parse_size(size), parse_size(block), max_seconds)
    cfg.check()
    if kind is not None and kind not in ("local-nvme", "parallel-fs", "object-store"):
        raise ConfigError(f"--kind {kind!r}: use local-nvme, parallel-fs or object-store")
    folder = resolve_target(target)
    tier_name = name or folder.name or "root"
    if not (1 <= len(tier_name) <= 64) or not tier_name.isprintable() or any(c in tier_name for c in "#/"):
        raise ConfigError(f"--name {tier_name[:80]!r}: 1 to 64 printable characters, without # or /")
    for path in (out, calibration):
        if path is not None:
            check_writable(path)  # before the measuring, not after
    result = run_storage_bench(folder, cfg)
    tier_kind: Kind = kind or guess_kind(result.filesystem)  # type: ignore[assignment]  # checked above
    tier = result.tier(tier_name, tier_kind)
    notes = []
    if out is not None:
        out.write_text(json.dumps(tier.model_dump(), indent=2) + "\n")
        notes.append(f"tier file written to {out}; use it with gpuyard plan --storage {out}")
    if calibration is not None:
        add_storage(calibration, tier_name, tier_kind, result)
        notes.append(
            f"tier {tier_name} added to {calibration}; use it with gpuyard plan --storage {calibration}"
        )
    if as_json:
        typer.echo(json.dumps({"name": tier_name, "kind": tier_kind, **result.model_dump()}))
        return
    lines = result.lines()
    guessed = "" if kind else f" (from the file system type {result.filesystem}; give --kind if it is not)"
    lines.insert(1, f"tier {tier_name}: {tier_kind}{guessed}")
    typer.echo("\n".join(lines + notes))


def register(app: typer.Typer) -> None:
    """Add `gpuyard fabric` to the root command."""
    app.add_typer(fabric_app, name="fabric")
