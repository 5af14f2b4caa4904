"""`gpuyard data`: ingest, transform, list and inspect dataset versions and their quarantine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpuyard.cli.progress import progress_reporter
from gpuyard.errors import ConfigError

data_app = typer.Typer(help="Versioned sharded datasets: ingest, transform, list, show, quarantine.")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"--shard-size {text!r}: use a number with an optional unit (KiB, MiB, GiB, MB, ...)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _hw(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m:
        raise ConfigError(f"--image-size {text!r}: use HEIGHTxWIDTH, e.g. 28x28")
    return int(m.group(1)), int(m.group(2))


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    q = manifest["quarantine"]
    return {
        "dataset": manifest["name"],
        "version": manifest["version"],
        "ref": f"{manifest['name']}@{manifest['version']}",
        "kind": manifest["kind"],
        "parent": manifest.get("parent"),
        "rows": manifest["num_rows"],
        "shards": len(manifest["shards"]),
        "bytes": sum(s["bytes"] for s in manifest["shards"]),
        "rows_in": q["rows_in"],
        "rows_quarantined": q["rows_quarantined"],
        "quarantine": q["by_reason"],
        "splits": manifest.get("splits") or {},
        "imputed": [
            {"column": c, **d}
            for c, d in sorted(((manifest.get("recipe") or {}).get("imputed") or {}).items())
        ],
    }


def _print_summary(doc: dict[str, Any]) -> None:
    console = Console()
    console.print(
        f"[bold]{doc['ref']}[/bold]  {doc['rows']} rows in {doc['shards']} shard(s), {doc['bytes']} bytes; "
        f"{doc['rows_in']} in, {doc['rows_quarantined']} quarantined {doc['quarantine'] or ''}".rstrip()
    )
    if doc["splits"]:
        console.print("splits: " + ", ".join(f"{k}={v}" for k, v in doc["splits"].items()))
    for d in doc.get("imputed") or []:
        console.print(
            escape(f"imputed column {d['column']!r}: {d['how']} = {d['value']!r} into {d['rows']} row(s)"),
            soft_wrap=True,
        )


@data_app.command("ingest")
def ingest_cmd(
    src: Path = typer.Argument(
        ...,
        help="CSV, Parquet, JSONL, .npy/.npz file, an image folder (one folder per class), or a text "
        "corpus: a .txt/.md file or a folder of them (subfolders included).",
    ),
    name: str = typer.Option(..., "--name", help="Dataset name."),
    fmt: str | None = typer.Option(
        None,
        "--format",
        help="csv, parquet, jsonl, npy, npz, images or text (default: guessed; a folder holding "
        ".txt/.md files and no images is text).",
    ),
    label_column: str | None = typer.Option(None, "--label-column", help="Column holding the labels."),
    labels: str | None = typer.Option(None, "--labels", help="Declared label set, comma-separated."),
    checks: Path | None = typer.Option(None, "--checks", help="Validation rules (YAML)."),
    shard_size: str = typer.Option("128MiB", "--shard-size", help="Target shard size."),
    image_size: str | None = typer.Option(None, "--image-size", help="Resize images to HEIGHTxWIDTH."),
    team: str | None = typer.Option(
        None,
        "--team",
        help="The team a new dataset belongs to (default: default; a new version keeps its dataset's).",
    ),
    text_field: str | None = typer.Option(
        None, "--text-field", help="Text corpus: the field holding each document (JSONL/Parquet)."
    ),
    messages_field: str | None = typer.Option(
        None, "--messages-field", help="Chat corpus: the field holding a list of {role, content} messages."
    ),
    max_doc_bytes: str = typer.Option(
        "1MiB", "--max-doc-bytes", help="Text: larger documents are quarantined."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Ingest a source into a new immutable version (bad rows go to the quarantine, with reasons).

    A .txt/.md file, a folder of them (subfolders included), --format text or
    --text-field/--messages-field ingests a text corpus (docs/llm.md).

    Prints a schema summary (column, type, nulls, warnings); a text column that is numbers but for a
    few values becomes numeric, those rows quarantined with the value as the file held it. An empty
    source (a header-only CSV) is refused.
    """
    from gpuyard.cli.text import ingest_text_cmd, is_text_source

    if is_text_source(src, fmt, text_field, messages_field):
        args = (src, name, fmt, text_field, messages_field, _size(max_doc_bytes), _size(shard_size), team)
        ingest_text_cmd(*args, as_json, _summary, _print_summary)
        return
    import yaml

    from gpuyard.data import IngestOptions, ValidationSpec, ingest
    from gpuyard.data.infer import schema_summary
    from gpuyard.data.sources import check_text_file
    from gpuyard.errors import one_line

    spec = ValidationSpec()
    if checks is not None:
        if not checks.is_file():
            raise ConfigError(f"--checks {checks}: file not found")
        try:
            check_text_file(checks, "YAML")
        except ConfigError as exc:
            raise ConfigError(f"--checks {exc}") from exc
        try:
            spec = ValidationSpec.model_validate(yaml.safe_load(checks.read_text()) or {})
        except yaml.MarkedYAMLError as exc:  # file:line:column of the problem, as compilers say it
            mark = exc.problem_mark or exc.context_mark
            where = f"{checks}:{mark.line + 1}:{mark.column + 1}" if mark else str(checks)
            raise ConfigError(f"--checks {where}: {one_line(str(exc.problem or exc))}") from exc
        except Exception as exc:  # pydantic or YAML: one line naming the file
            raise ConfigError(f"--checks {checks}: {one_line(str(exc))}") from exc
    label_set: list[Any] | None = None
    if labels:
        label_set = [x.strip() for x in labels.split(",") if x.strip()]
    opts = IngestOptions(
        format=fmt,
        label_column=label_column,
        labels=label_set,
        checks=spec,
        shard_bytes=_size(shard_size),
        image_size=_hw(image_size),
    )
    with progress_reporter(not as_json) as report:
        version = ingest(src, name, opts, progress=report, team=team)
    from gpuyard.data.ingest import header_warning

    doc = _summary(version.manifest)
    doc["schema"] = schema_summary(version.manifest)
    header = header_warning(version.manifest["quarantine"])
    doc["warnings"] = [header] if header else []
    if header:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {escape(header)}", soft_wrap=True)
    if as_json:
        _warn_schema(doc["schema"])
        typer.echo(json.dumps(doc))
    else:
        _print_summary(doc)
        _print_schema(doc["schema"])


def _print_schema(rows: list[dict[str, Any]]) -> None:
    """The schema summary: column, type, nulls, warnings (in yellow)."""
    table = Table("column", "type", "nulls", "warnings")
    for r in rows:
        warned = escape("; ".join(r["warnings"]))
        table.add_row(
            r["column"], str(r["type"]), str(r["nulls"]), f"[yellow]{warned}[/yellow]" if warned else "-"
        )
    Console().print(table)


def _warn_schema(rows: list[dict[str, Any]]) -> None:
    """Each warning of the schema summary as a line on stderr (with --json, where no table is printed)."""
    err = Console(stderr=True)
    for r in rows:
        for w in r["warnings"]:
            err.print(
                f"[yellow]warning:[/yellow] column {escape(repr(r['column']))}: {escape(w)}", soft_wrap=True
            )


@data_app.command("transform")
def transform_cmd(
    ref: str = typer.Argument(..., help="Input dataset: NAME or NAME@VERSION."),
    recipe: Path = typer.Option(..., "--recipe", help="Recipe (YAML)."),
    output: str | None = typer.Option(
        None, "--output", help="Name of the result (default: a new version of NAME)."
    ),
    engine: str = typer.Option(
        "pool", "--engine", help="pool (local processes), thread (local threads), ray (Ray tasks) or serial."
    ),
    workers: int | None = typer.Option(None, "--workers", help="Process-pool size (default: CPU count)."),
    ray_address: str | None = typer.Option(None, "--ray", help="Ray cluster address for --engine ray."),
    team: str | None = typer.Option(
        None,
        "--team",
        help="The team of a new --output dataset (default: default; a new version keeps its dataset's).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Run a recipe (features, split, normalize, encode) over a version; the result is a new version."""
    from gpuyard.data import load_recipe, transform

    rec = load_recipe(recipe)
    with progress_reporter(not as_json) as report:
        version = transform(
            ref,
            rec,
            output=output,
            engine=engine,
            workers=workers,
            ray_address=ray_address,
            progress=report,
            team=team,
        )
    from gpuyard.data.ingest import imputation_leak_warning

    doc = _summary(version.manifest)
    doc["fitted"] = version.fitted
    leak = imputation_leak_warning(version.manifest)
    doc["warnings"] = [leak] if leak else []
    if leak:
        Console(stderr=True).print(f"[yellow]warning:[/yellow] {escape(leak)}", soft_wrap=True)
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        _print_summary(doc)


@data_app.command("ls")
def ls_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List datasets with their latest version."""
    from gpuyard.data import list_datasets

    rows = list_datasets()
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = Table("dataset", "team", "latest", "versions", "rows", "shards", "quarantined", "created")
    for r in rows:
        table.add_row(
            r["dataset"], r["team"], r["version"], str(r["versions"]), str(r["rows"]), str(r["shards"]),
            str(r["rows_quarantined"]), r["created_at"][:19],
        )  # fmt: skip
    Console().print(table)


@data_app.command("show")
def show_cmd(
    ref: str = typer.Argument(..., help="NAME or NAME@VERSION."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole manifest as JSON."),
) -> None:
    """Show a version: schema, statistics, lineage, recipe and quarantine counts."""
    from gpuyard.data import list_versions, open_dataset

    version = open_dataset(ref)
    if as_json:
        typer.echo(json.dumps(version.manifest))
        return
    _print_summary(_summary(version.manifest))
    if version.manifest.get("kind") == "tokens" and isinstance(version.manifest.get("tokens"), dict):
        from gpuyard.cli.text import print_tokens

        print_tokens(version.manifest["tokens"], version.ref)
    console = Console()
    lineage = [f"{version.ref} ({version.manifest['kind']} of {version.manifest['source'].get('uri')})"]
    parent = version.manifest.get("parent")
    if parent:
        lineage.append(f"parent {parent}")
    console.print("lineage: " + "; ".join(lineage))
    console.print(
        f"versions of {version.name}: " + ", ".join(v["version"] for v in list_versions(version.name))
    )
    table = Table("column", "type", "count", "nulls", "min", "max", "mean", "std", "distinct")
    stats = version.stats
    for col in version.manifest["schema"]:
        s = stats.get(col["name"], {})
        kind = col["kind"] + (f" {tuple(col['tensor']['shape'])}" if "tensor" in col else "")
        table.add_row(
            col["name"], kind, str(s.get("count", "")), str(s.get("nulls", "")),
            _fmt(s.get("min")), _fmt(s.get("max")), _fmt(s.get("mean")), _fmt(s.get("std")),
            str(s.get("distinct", "")),
        )  # fmt: skip
    console.print(table)
    from gpuyard.data.infer import schema_summary

    for r in schema_summary(version.manifest):
        for w in r["warnings"]:
            console.print(
                f"[yellow]warning:[/yellow] column {escape(repr(r['column']))}: {escape(w)}", soft_wrap=True
            )
    if version.fitted:
        console.print("fitted: " + json.dumps(version.fitted)[:2000])


def _fmt(x: Any) -> str:
    return "" if x is None else f"{x:.4g}"


@data_app.command("quarantine")
def quarantine_cmd(
    ref: str = typer.Argument(..., help="NAME@VERSION (or NAME for the latest)."),
    limit: int = typer.Option(20, "--limit", help="Rows to print (0: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the rows quarantined when a version was made, with the reason for each."""
    from gpuyard.data import open_dataset

    version = open_dataset(ref)
    table = version.quarantine()
    rows = table.to_pylist() if limit == 0 else table.slice(0, limit).to_pylist()
    q = version.manifest["quarantine"]
    doc = {
        "ref": version.ref,
        "rows_in": q["rows_in"],
        "rows_kept": q["rows_kept"],
        "rows_quarantined": q["rows_quarantined"],
        "by_reason": q["by_reason"],
        "rows": [{**r, "values": json.loads(r["values"])} for r in rows],
    }
    if as_json:
        typer.echo(json.dumps(doc))
        return
    console = Console()
    console.print(
        f"[bold]{version.ref}[/bold]: {q['rows_in']} in = {q['rows_kept']} kept"
        f" + {q['rows_quarantined']} quarantined"
    )
    where = "source" in table.column_names  # text corpora: the file and line of each record
    out = Table("row", *(["source"] if where else []), "reason", "values")
    for r in rows:
        out.add_row(str(r["row"]), *([r["source"]] if where else []), r["reason"], r["values"][:100])
    console.print(out)


@data_app.command("verify")
def verify_cmd(
    ref: str = typer.Argument(..., help="NAME@VERSION (or NAME for the latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Hash every stored object of a version (manifest, shards, quarantine) and compare with the catalog.

    Exits 0 when all match; 1 with one line per bad object (which shard, missing or what it hashes to).
    """
    from gpuyard.data.integrity import verify_version

    report = verify_version(ref)
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        err = Console(stderr=True)
        for b in report.bad:
            err.print(
                f"[red]bad:[/red] {report.ref} {b['object']} {b['key']}: {escape(b['problem'])}",
                soft_wrap=True,
            )
        state = "ok" if report.ok else f"{len(report.bad)} bad"
        Console().print(
            f"{report.ref}: {report.checked} objects, {report.bytes} bytes checked: {state}", soft_wrap=True
        )
    if not report.ok:
        raise typer.Exit(1)


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ConfigError(f"--grace {text!r}: use a number with an optional unit s, m, h or d (e.g. 24h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@data_app.command("gc")
def gc_cmd(
    yes: bool = typer.Option(False, "--yes", help="Delete (default: only list what would be deleted)."),
    grace: str = typer.Option(
        "24h", "--grace", help="Never touch a blob written less than this long ago (an ingest in progress)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Remove blobs that no dataset version, model or run references (a dry run unless --yes).

    A blob counts as referenced when the state store or a recorded manifest names its SHA-256.
    """
    from gpuyard.data.integrity import collect_garbage

    report = collect_garbage(delete=yes, grace_s=_duration(grace))
    if as_json:
        typer.echo(json.dumps(report.to_json()))
        return
    con = Console()
    verb = "deleted" if yes else "would delete (dry run; --yes to delete)"
    for key in report.unreferenced:
        con.print(f"{'deleted' if yes else 'unreferenced'} {key}", soft_wrap=True)
    con.print(
        f"{verb} {len(report.unreferenced)} blob(s), {report.bytes} bytes; kept {report.referenced} "
        f"referenced and {report.too_new} newer than {grace}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add `gpuyard data` to the CLI."""
    from gpuyard.cli.text import register_text

    register_text(data_app)
    app.add_typer(data_app, name="data")
