"""Training a byte-level BPE tokenizer (``gpuyard llm tokenizer``) on text datasets and text files."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpuyard.data.dataset import open_dataset
from gpuyard.data.tokenizer import DEFAULT_CHAT_TEMPLATE, render_chat
from gpuyard.data.tokens import MAX_SEQ_LEN, _column
from gpuyard.errors import ConfigError

# The role markers gpuyard's default chat template writes: special tokens of a tokenizer trained for chat.
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
MAX_VOCAB = 1 << 20


def check_vocab_size(vocab_size: int, specials: int) -> None:
    """Refuse a vocabulary size a byte-level BPE tokenizer cannot have.

    Raises:
        ConfigError: not over the 256 bytes plus ``specials`` special tokens, or over ``MAX_VOCAB``.
    """
    if not 256 + specials < vocab_size <= MAX_VOCAB:
        raise ConfigError(
            f"vocab size {vocab_size}: must be over {256 + specials} (256 bytes and {specials} special "
            f"tokens) and at most {MAX_VOCAB}"
        )


def train_tokenizer(
    texts: Iterable[str], out: str | Path, vocab_size: int = 512, extra_tokens: tuple[str, ...] = ()
) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` with ``tokenizers`` and write it as a Hugging Face
    tokenizer folder (tokenizer.json, tokenizer_config.json with gpuyard's chat template); returns it.

    Special tokens: ``<|endoftext|>`` (end of sequence), ``<pad>``, then ``extra_tokens``.

    The vocabulary always holds the 256 bytes and the special tokens (more than ``vocab_size`` when
    it is smaller: :func:`check_vocab_size` refuses that for a user's request).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", *extra_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<pad>",
        "bos_token": None,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
        "model_max_length": MAX_SEQ_LEN,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def corpus_texts(
    datasets: list[str], files: list[Path], counts: dict[str, int] | None = None
) -> Iterator[str]:
    """The texts of text dataset versions (chat records rendered with gpuyard's chat template) and of
    text files (a folder: its .txt/.md/.text/.rst files, subfolders included; each file one text),
    to train a tokenizer on. Files that are not UTF-8 text are skipped, counted in ``counts``.

    Raises:
        ConfigError: a dataset that is not text, a path that does not exist.
    """
    from gpuyard.data.text import decode_text, text_files

    counts = counts if counts is not None else {}
    for key in ("documents", "bytes", "skipped"):
        counts.setdefault(key, 0)
    for ref in datasets:
        version = open_dataset(ref)
        column = _column(version)
        for table in version.iter_tables(columns=[column]):
            for value in table.column(column).to_pylist():
                text = value if column == "text" else render_chat(DEFAULT_CHAT_TEMPLATE, value, False, "")
                counts["documents"] += 1
                counts["bytes"] += len(text.encode("utf-8", "surrogatepass"))
                yield text
    for path in files:
        if not path.exists():
            raise ConfigError(f"{path}: no such file or folder")
        for f in text_files(path) if path.is_dir() else [path]:
            text, why = decode_text(f.read_bytes())
            if text is None or why is not None:
                counts["skipped"] += 1
                continue
            counts["documents"] += 1
            counts["bytes"] += len(text.encode("utf-8"))
            yield text
