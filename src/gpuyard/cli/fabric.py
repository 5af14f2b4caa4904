"""`gpuyard fabric ...`: cluster presets, the collective cost model and measured collectives."""

from __future__ import annotations

import json

import typer

fabric_app = typer.Typer(help="The fabric between GPUs: clusters, collective model, measured collectives.")


@fabric_app.command("clusters")
def clusters(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the cluster presets (files in gpuyard/fabric/presets plus `local`)."""
    from rich.console import Console
    from rich.table import Table

    from gpuyard.fabric.cluster import list_presets, load_cluster

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


@fabric_app.command("show")
def show(
    cluster: str = typer.Argument(..., help="Preset name or YAML/JSON cluster file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a cluster description (the same YAML a cluster file holds)."""
    import yaml

    from gpuyard.fabric.cluster import load_cluster

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
    from gpuyard.fabric.cluster import load_cluster
    from gpuyard.fabric.collectives import estimate
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


def register(app: typer.Typer) -> None:
    """Add `gpuyard fabric` to the root command."""
    app.add_typer(fabric_app, name="fabric")
