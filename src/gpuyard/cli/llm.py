"""`gpuyard llm`: register, evaluate (perplexity), merge and promote language models (docs/llm.md)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import typer
from rich.console import Console

llm_app = typer.Typer(
    help="Language models: register, perplexity, LoRA merge, promotion gated on perplexity."
)


@llm_app.command("register")
def register_cmd(
    name: str = typer.Argument(..., help="Model name."),
    folder: Path = typer.Argument(..., help="An exported Hugging Face folder (a run's <run_dir>/hf)."),
    base: str | None = typer.Option(None, "--base", help="Register the folder's LoRA adapter of this model."),
    team: str | None = typer.Option(None, "--team", help="The team of a new model."),
    run: str | None = typer.Option(
        None, "--run", help="The training run it came from (default: the one its gpuyard.json names)."
    ),
    dataset: str | None = typer.Option(
        None, "--dataset", help="The dataset it was trained on (default: its gpuyard.json's, else the run's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Register a causal LM (with its tokenizer and context length), or with --base a LoRA adapter.

    Prints its lineage (run and dataset), "unknown" for what neither the options nor the export say.
    """
    from gpuyard.models.llm import lineage_line, register_lm

    mv = register_lm(name, folder, base=base, team=team, run_id=run, dataset=dataset)
    doc = {
        "ref": mv.ref, "flavor": mv.flavor, **mv.config, "metrics": mv.metrics, "run_id": mv.run_id,
        "dataset_version": mv.dataset_version,
    }  # fmt: skip
    if as_json:
        typer.echo(json.dumps(doc))
        return
    extra = f", adapter of {mv.config['base']}" if base else ""
    con = Console()
    con.print(f"[bold]{mv.ref}[/bold] {mv.flavor}, context {mv.config.get('context_length')}{extra}")
    con.print(lineage_line(mv), markup=False, highlight=False)


@llm_app.command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="A registered language model or a Hugging Face folder."),
    data: str = typer.Option(..., "--data", help="A token dataset (gpuyard data tokenize)."),
    split: str = typer.Option(
        "val", "--split", help="The split to evaluate (the whole dataset when it has none)."
    ),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    prompt: list[str] = typer.Option(
        [],
        "--prompt",
        help="A prompt to generate from (repeat; default: the start of the split's documents).",
    ),
    samples: int = typer.Option(
        3, "--samples", min=0, max=32, help="Default prompts taken (0: no generations)."
    ),
    sample_tokens: int = typer.Option(
        16, "--sample-tokens", min=1, max=1024, help="Tokens generated per prompt."
    ),
    record: bool = typer.Option(
        True, "--record/--no-record", help="Store the evaluation with the registered model and its run."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Perplexity over every sequence of a token dataset (loss and tokens counted exactly), and greedy
    generations of a fixed set of prompts; both are stored with a registered model (`gpuyard runs show`)."""
    from gpuyard.cli.progress import progress_reporter
    from gpuyard.models.llm import evaluate_lm

    settings = {"prompts": prompt or None, "count": samples, "max_new_tokens": sample_tokens}
    if as_json:  # quiet: transformers' own bars (loading weights) too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with progress_reporter(not as_json) as report:
        out = evaluate_lm(model, data, split, batch_size, samples=settings, record=record, progress=report)
    if as_json:
        typer.echo(json.dumps(out))
        return
    con = Console()
    con.print(
        f"{model} on {out['dataset']} ({out['split']}): perplexity {out['val_perplexity']:.4f}, "
        f"loss {out['val_loss_tokens']:.4f} over {int(out['val_tokens'])} tokens"
    )
    for sample in out["samples"]:
        con.print(f"  {sample['prompt']!r} -> {sample['completion']!r}", markup=False, highlight=False)


@llm_app.command("merge")
def merge_cmd(
    adapter: str = typer.Argument(..., help="A registered LoRA adapter (NAME:VERSION)."),
    name: str | None = typer.Option(
        None, "--name", help="Register the merged model as (default: the base's name)."
    ),
) -> None:
    """Merge a LoRA adapter into its base and register the result as a full model version."""
    from gpuyard.models.llm import lineage_line, merge_adapter

    mv = merge_adapter(adapter, name)
    con = Console()
    con.print(f"[bold]{mv.ref}[/bold] = {adapter} merged into {mv.description.split(' into ')[-1]}")
    con.print(lineage_line(mv), markup=False, highlight=False)


@llm_app.command("promote")
def promote_cmd(
    model: str = typer.Argument(..., help="NAME:VERSION to promote."),
    data: str = typer.Option(..., "--data", help="The token dataset perplexity is measured on."),
    max_perplexity: float | None = typer.Option(
        None, "--max-perplexity", help="Refuse above this perplexity."
    ),
    split: str = typer.Option("val", "--split"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Promote to production when perplexity passes the gate and is no worse than production's."""
    from gpuyard.exitcodes import USAGE
    from gpuyard.models.llm import promote_lm

    decision = promote_lm(model, data, max_perplexity, split)
    if as_json:
        typer.echo(json.dumps(decision))
    else:
        verdict = "promoted" if decision["promoted"] else "not promoted"
        Console().print(f"{model}: {verdict} (perplexity {decision['perplexity']:.4f}): {decision['reason']}")
    if not decision["promoted"]:
        raise typer.Exit(USAGE)


tokenizer_app = typer.Typer(help="Tokenizers: train one from your own text.")
llm_app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("train")
def tokenizer_train_cmd(
    out: Path = typer.Option(
        ..., "--out", help="The folder to write (tokenizer.json, tokenizer_config.json)."
    ),
    data: list[str] = typer.Option(
        [],
        "--data",
        help="A text dataset NAME[@VERSION] (repeat; chat records rendered with gpuyard's template).",
    ),
    files: list[Path] = typer.Option(
        [], "--files", help="A text file, or a folder of .txt/.md files with its subfolders (repeat)."
    ),
    vocab_size: int = typer.Option(
        8000, "--vocab-size", help="Tokens in the vocabulary, special ones included."
    ),
    special: list[str] = typer.Option([], "--special", help="Another special token (repeat)."),
    chat_markers: bool = typer.Option(
        True,
        "--chat-markers/--no-chat-markers",
        help="Make the chat template's role markers (<|user|>, <|assistant|>, ...) special tokens.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Train a byte-level BPE tokenizer (the tokenizers library, offline) on datasets and text files.

    The folder is what `gpuyard data tokenize --tokenizer` and transformers' AutoTokenizer read:
    <|endoftext|> ends a sequence, <pad> pads, and the chat template is gpuyard's.
    """
    from gpuyard.data.tokenizer import load_tokenizer
    from gpuyard.data.tokenizer_train import CHAT_MARKERS, check_vocab_size, corpus_texts, train_tokenizer
    from gpuyard.errors import ConfigError

    if not data and not files:
        raise ConfigError("give the text to train on: --data NAME[@VERSION] and/or --files PATH")
    if (out / "tokenizer.json").exists():
        raise ConfigError(f"{out} already holds a tokenizer.json; choose another --out")
    extra = tuple(dict.fromkeys([*(CHAT_MARKERS if chat_markers else ()), *special]))
    check_vocab_size(vocab_size, 2 + len(extra))
    counts: dict[str, int] = {}
    texts = corpus_texts(data, files, counts)
    first = next(texts, None)
    if first is None:  # nothing written
        raise ConfigError(f"no text to train on ({counts.get('skipped', 0)} files skipped as not UTF-8 text)")
    folder = train_tokenizer(itertools.chain([first], texts), out, vocab_size, extra)
    tok = load_tokenizer(folder)
    specials = ["<|endoftext|>", "<pad>", *extra]
    doc = {
        "folder": str(folder),
        "vocab_size": tok.vocab_size,
        "special_tokens": specials,
        "sha256": tok.sha256,
    }
    doc.update(counts)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    Console().print(
        f"{folder}: {tok.vocab_size} tokens from {counts['documents']} texts ({counts['bytes']} bytes"
        f"{', ' + str(counts['skipped']) + ' files skipped as not text' if counts['skipped'] else ''}); "
        f"special {', '.join(specials)}",
        markup=False,
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add `gpuyard llm`."""
    app.add_typer(llm_app, name="llm")
