"""`gpuyard llm tokenizer train`: a byte-level BPE tokenizer from datasets and text folders, in a folder
that transformers and `gpuyard data tokenize` read, with the chat role markers as special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.llm_fixtures import corpus
from typer.testing import CliRunner

from gpuyard.cli.main import app
from gpuyard.data.text import TextOptions, ingest_text
from gpuyard.data.tokens import load_tokenizer
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit


def test_a_tokenizer_trained_on_a_dataset_and_a_folder_loads_in_transformers(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    chats = [
        {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
        for a, b in zip(corpus(60), corpus(60, seed=5), strict=True)
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in chats))
    ref = ingest_text(src, "chat", TextOptions(messages_field="messages")).ref
    pages = tmp_path / "pages" / "sub"
    pages.mkdir(parents=True)
    (pages / "a.md").write_text("\n".join(corpus(40, seed=9)))
    (pages / "bin.txt").write_bytes(b"\x00\x01\x02 not text")
    out = tmp_path / "tok"
    runner = CliRunner()
    args = ["--out", str(out), "--data", ref, "--files", str(tmp_path / "pages"), "--vocab-size", "300"]
    res = runner.invoke(app, ["llm", "tokenizer", "train", *args, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    doc = json.loads(res.output)
    assert doc["documents"] == 61 and doc["skipped"] == 1 and doc["vocab_size"] == 300
    hf = AutoTokenizer.from_pretrained(out)
    text = "<|user|>\nthe cat sat.\n<|assistant|>\n"
    assert hf.decode(hf(text)["input_ids"]) == text
    tok = load_tokenizer(out)
    assert hf.convert_ids_to_tokens(hf("<|assistant|>")["input_ids"]) == ["<|assistant|>"]
    # The role markers are turn markers: an export stops generating at them.
    names = [tok.tokenizer.id_to_token(i) for i in tok.stop_ids()]
    assert names[0] == "<|endoftext|>" and {"<|user|>", "<|assistant|>", "<|system|>"} <= set(names)
    again = runner.invoke(app, ["llm", "tokenizer", "train", "--out", str(out), "--files", str(tmp_path)])
    assert isinstance(again.exception, ConfigError) and "already holds a tokenizer.json" in str(
        again.exception
    )
    small = runner.invoke(
        app, ["llm", "tokenizer", "train", "--out", str(tmp_path / "t2"), "--files", str(tmp_path / "pages"),
              "--vocab-size", "100"],
    )  # fmt: skip
    assert isinstance(small.exception, ConfigError) and "vocab size 100: must be over" in str(small.exception)
    none = runner.invoke(app, ["llm", "tokenizer", "train", "--out", str(tmp_path / "t3")])
    assert isinstance(none.exception, ConfigError) and "give the text to train on" in str(none.exception)
