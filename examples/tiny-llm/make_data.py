"""Generate the tiny-llm example's data offline: a story corpus, a small chat instruction set, a tokenizer.

Sentences come from a small grammar (seeded), so the model has structure to learn in a few hundred
steps; the tokenizer is a byte-level BPE trained on the corpus with `tokenizers` (no downloads).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from gpuyard.data.tokens import train_tokenizer

ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "owl", "mouse"]
COLOURS = ["red", "blue", "green", "small", "old", "young", "quick", "lazy"]
PLACES = ["garden", "river", "hill", "forest", "house", "field", "barn", "road"]
VERBS = ["saw", "found", "chased", "liked", "helped", "followed", "met", "watched"]


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    return (
        f"the {rng.choice(COLOURS)} {a} {rng.choice(VERBS)} the {rng.choice(COLOURS)} {b} "
        f"near the {rng.choice(PLACES)}."
    )


def main(out: Path, stories: int = 3000) -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(stories)]
    (out / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    chats = []
    for _ in range(400):
        a, colour, place = rng.choice(ANIMALS), rng.choice(COLOURS), rng.choice(PLACES)
        chats.append({"messages": [
            {"role": "user", "content": f"where is the {colour} {a}?"},
            {"role": "assistant", "content": f"the {colour} {a} is near the {place}."},
        ]})  # fmt: skip
    (out / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    train_tokenizer(
        docs + [m["content"] for c in chats for m in c["messages"]], out / "tokenizer", vocab_size=256
    )
    config = {
        "model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 0, "pad_token_id": 1,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"{out}: corpus.txt ({len(docs)} stories), chat.jsonl ({len(chats)}), tokenizer/, config.json")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data"))
