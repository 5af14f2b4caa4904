"""Generate the tiny-llm example's data offline: a story corpus, a small chat instruction set, a tokenizer.

Sentences come from a small grammar (seeded), so the model has structure to learn in a few dozen
steps. Like web text, the pre-training corpus also holds some dialogues in the chat template's format
("what did the red fox do?" answered from the question); the chat set teaches another question ("where
is the red fox?"), which the base model has never seen answered. The tokenizer is a byte-level BPE
trained on all of it with `tokenizers` (no downloads). ``data_stage`` is the pipeline's first stage
(``uses: make_data:data_stage``); ``python make_data.py DIR`` writes the same files by hand.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from gpuyard.data.tokenizer import DEFAULT_CHAT_TEMPLATE, render_chat
from gpuyard.data.tokenizer_train import train_tokenizer

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


VOCAB = 512


def chat(question: str, answer: str) -> list[dict[str, str]]:
    """A chat record: one user question, one assistant answer."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def main(
    out: Path, stories: int = 3000, dialogues: int = 600, chats: int = 400, seed: int = 0
) -> dict[str, str]:
    """Write corpus.txt, chat.jsonl, tokenizer/ and config.json (a 0.87M-parameter Llama) into ``out``."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    # The chat template rendered once around placeholders (compiling it per record costs ms each).
    frame = render_chat(DEFAULT_CHAT_TEMPLATE, chat("\0Q", "\0A"), False, "")

    def dialogue(question: str, answer: str) -> str:
        return frame.replace("\0Q", question).replace("\0A", answer)

    docs = [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(stories)]
    for _ in range(dialogues):  # "what did X do?" answered from the question, in the chat format
        said = sentence(rng)
        subject = " ".join(said.split()[:3])
        question = f"what did {subject} do?"
        docs.insert(rng.randrange(len(docs) + 1), dialogue(question, said))
    (out / "corpus.txt").write_text("\n\n".join(d.strip() for d in docs) + "\n")
    records = []
    for _ in range(chats):  # the fine-tuning set: another question, a few of them repeated
        a, colour, place = rng.choice(ANIMALS), rng.choice(COLOURS), rng.choice(PLACES)
        records.append(
            {"messages": chat(f"where is the {colour} {a}?", f"the {colour} {a} is near the {place}.")}
        )
    (out / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in records) + "\n")
    texts = docs + [dialogue(c["messages"][0]["content"], c["messages"][1]["content"]) for c in records]
    train_tokenizer(texts, out / "tokenizer", vocab_size=VOCAB)
    config = {
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 0, "pad_token_id": 1,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {k: str(out / f) for k, f in (("corpus", "corpus.txt"), ("chat", "chat.jsonl"),
                                          ("tokenizer", "tokenizer"), ("config", "config.json"))}  # fmt: skip


def data_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Pipeline stage: the example's files in the stage's own folder (outputs: their paths)."""
    n = {k: int(inputs.get(k, d)) for k, d in (("stories", 3000), ("dialogues", 600), ("chats", 400))}
    paths = main(Path(ctx["workdir"]) / "data", **n, seed=int(inputs.get("seed", 0)))
    return {
        **paths,
        "report": [
            f"{n['stories']} stories and {n['dialogues']} dialogues (corpus.txt), {n['chats']} chat records"
            f" (chat.jsonl), a {VOCAB}-token byte-level BPE, a Llama config (4 layers, hidden 128)"
        ],
    }


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "data")
    main(folder)
    print(f"{folder}: corpus.txt, chat.jsonl, tokenizer/, config.json")
