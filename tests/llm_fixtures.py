"""A small generated corpus and a tokenizer trained on it, for the language-model tests (no downloads)."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "ran",
    "flew",
    "on",
    "under",
    "over",
    "mat",
    "tree",
    "roof",
    "and",
    "then",
    "quickly",
    "slowly",
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "young",
    "house",
    "garden",
    "river",
    "hill",
    "saw",
    "found",
    "ate",
    "liked",
]


def corpus(n: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct sentences of 3 to 30 words."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "."
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def tokenizer_folder(tmp: Path, vocab_size: int = 200) -> Path:
    """A byte-level BPE tokenizer folder trained on :func:`corpus`."""
    from gpuyard.data.tokenizer_train import train_tokenizer

    return train_tokenizer(corpus(300, seed=1), tmp / "tokenizer", vocab_size=vocab_size)


def token_dataset(tmp: Path, docs: int, val_fraction: float) -> tuple[str, Path]:
    """A packed token dataset (32-token sequences) of ``docs`` corpus documents, in the current
    GPUYARD_HOME: (its reference, the tokenizer folder)."""
    import json

    from gpuyard.data.text import ingest_text
    from gpuyard.data.tokens import tokenize

    folder = tokenizer_folder(tmp)
    src = tmp / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in corpus(docs)))
    v = tokenize(ingest_text(src, "corpus").ref, folder, seq_len=32, val_fraction=val_fraction, seed=0)
    return v.ref, folder
