"""`gpuyard data ingest` of text corpora and `gpuyard data tokenize` (language models, docs/llm.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape


def is_text_source(src: Path, fmt: str | None, text_field: str | None, messages_field: str | None) -> bool:
    """True when ``gpuyard data ingest`` should read ``src`` as a text corpus."""
    # Imported here: gpuyard.data loads pyarrow and the catalog, which every other command would pay for.
    from gpuyard.data.sources import IMAGE_SUFFIXES
    from gpuyard.data.text import TEXT_SUFFIXES

    if text_field or messages_field or fmt in ("text", "txt"):
        return True
    if fmt is not None:
        return False
    if src.is_dir():
        # Text files anywhere below it and no image: a text corpus (subfolders are read too).
        suffixes = {p.suffix.lower() for p in src.rglob("*") if p.is_file()}
        return bool(suffixes & TEXT_SUFFIXES) and not suffixes & IMAGE_SUFFIXES
    return src.suffix.lower() in TEXT_SUFFIXES


def ingest_text_cmd(
    src: Path,
    name: str,
    fmt: str | None,
    text_field: str | None,
    messages_field: str | None,
    max_doc_bytes: int,
    shard_bytes: int,
    team: str | None,
    as_json: bool,
    summary: Any,
    print_summary: Any,
) -> None:
    """Ingest a text corpus (documents or chat records) and print its summary."""
    from gpuyard.data.text import TextOptions, ingest_text

    opts = TextOptions(
        format=fmt,
        text_field=text_field or "text",
        messages_field=messages_field,
        max_bytes=max_doc_bytes,
        shard_bytes=shard_bytes,
    )
    version = ingest_text(src, name, opts, team=team)
    doc = summary(version.manifest)
    doc["text"] = version.manifest["text"]
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        print_summary(doc)
        t = doc["text"]
        what = "chat records" if t["column"] == "messages" else "documents"
        Console().print(f"{t['documents']} {what}, {t['bytes']} bytes of text")


def register_text(app: typer.Typer) -> None:
    """Add `gpuyard data tokenize`."""

    @app.command("tokenize")
    def tokenize_cmd(
        ref: str = typer.Argument(..., help="A text dataset: NAME or NAME@VERSION."),
        tokenizer: Path = typer.Option(
            ...,
            "--tokenizer",
            help="A Hugging Face tokenizer.json or SentencePiece .model file, or a folder holding one.",
        ),
        seq_len: int = typer.Option(..., "--seq-len", help="Tokens per packed sequence."),
        output: str | None = typer.Option(
            None, "--output", help="Name of the token dataset (default NAME-tokens)."
        ),
        val_fraction: float = typer.Option(
            0.0, "--val-fraction", help="Share of documents in a 'val' split (by a seeded hash of the text)."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the train/val assignment."),
        eos_token: str | None = typer.Option(
            None, "--eos-token", help="The end-of-sequence token (default: the tokenizer's)."
        ),
        team: str | None = typer.Option(None, "--team", help="The team of a new token dataset."),
        over_length: str | None = typer.Option(
            None,
            "--over-length",
            help="A record over --seq-len tokens: split (into several sequences), truncate or drop "
            "(default: split for documents, truncate for chat records).",
        ),
        loss_on: str | None = typer.Option(
            None,
            "--loss-on",
            help="Chat records: assistant (the default: loss on assistant turns only) or all (every token).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Tokenize a text version and pack it into fixed-length sequences (document boundaries kept).

        Prints how many records were over --seq-len tokens and what became of them (--over-length).
        """
        from gpuyard.cli.progress import progress_reporter
        from gpuyard.data.tokens import tokenize

        with progress_reporter(not as_json) as report:
            version = tokenize(
                ref, tokenizer, seq_len, output=output, val_fraction=val_fraction, seed=seed,
                eos_token=eos_token, team=team, over_length=over_length, loss_on=loss_on, progress=report,
            )  # fmt: skip
        t = dict(version.manifest["tokens"])
        doc = {"ref": version.ref, "parent": version.manifest["parent"], **t}
        doc["tokenizer"] = {k: v for k, v in t["tokenizer"].items() if k != "chat_template"}
        err = Console(stderr=True)
        for note in t.get("warnings") or []:
            err.print(f"[yellow]warning:[/yellow] {escape(note)}", soft_wrap=True)
        if as_json:
            typer.echo(json.dumps(doc))
            return
        print_tokens(t, version.ref)


def print_tokens(t: dict[str, Any], ref: str) -> None:
    """The summary lines of a token dataset (``data tokenize``, ``data show``)."""
    from gpuyard.data.tokens import long_records_line

    con = Console()
    con.print(
        f"[bold]{ref}[/bold]  {t['sequences']} sequences of {t['seq_len']} tokens from "
        f"{t['documents']} documents: {t['tokens']} tokens, {t['padding']} padding "
        f"(waste {t['waste']:.2%}), {t['label_tokens']} in the loss"
        f"{' (assistant turns only)' if t.get('loss_on') == 'assistant' else ''}, "
        f"tokenizer sha256 {t['tokenizer']['sha256'][:12]}"
    )
    line = long_records_line(t)
    if line:
        con.print(line, markup=False, highlight=False)
