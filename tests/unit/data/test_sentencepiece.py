"""SentencePiece tokenizers (`*.model`): loaded, converted and checked against sentencepiece itself,
hashed, refused in one line when corrupt, and used by `gpuyard data tokenize`. The models are trained
here by sentencepiece on a small generated corpus (no downloads)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from tests.llm_fixtures import corpus

from gpuyard.data import tokenizer as tokenizer_mod
from gpuyard.data.text import ingest_text
from gpuyard.data.tokens import load_tokenizer, tokenize, tokenizer_bytes
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit

UNICODE = "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e \U0001f642"


def train_spm(out: Path, model_type: str = "unigram", byte_fallback: bool = True, **extra: object) -> Path:
    """A SentencePiece model trained on the test corpus (a few hundred lines, small vocabulary)."""
    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([*corpus(300, seed=1), UNICODE]), model_writer=buf, model_type=model_type,
        vocab_size=330 if byte_fallback else 60, hard_vocab_limit=False, byte_fallback=byte_fallback,
        minloglevel=2, **extra,
    )  # fmt: skip
    out.write_bytes(buf.getvalue())
    return out


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_a_sentencepiece_model_encodes_and_decodes_as_sentencepiece_does(
    tmp_path: Path, model_type: str
) -> None:
    import sentencepiece
    from tokenizers import Tokenizer

    path = train_spm(tmp_path / "sp.model", model_type)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tok = load_tokenizer(path)
    texts = [*corpus(50, seed=9), "  two  spaces, a\ttab and\nlines ", "emoji \U0001f642 and \u00e9t\u00e9"]
    assert tok.encode_batch(texts) == sp.encode(texts)
    # The converted tokenizer.json (what datasets store and models export) agrees too, and decodes
    # sentencepiece's "\u2581" back to spaces.
    converted = Tokenizer.from_str(tok.raw.decode())
    for text, ids in zip(texts, sp.encode(texts), strict=True):
        assert converted.encode(text, add_special_tokens=False).ids == ids
        assert converted.decode(ids) == sp.decode(ids)
    assert " the " in converted.decode(sp.encode("a cat saw the dog")) and "\u2581" not in converted.decode(
        ids
    )
    # Identity: eos from the model, the hash of the stored tokenizer.json, the source file's own hash.
    assert tok.eos_token == "</s>" and tok.eos_id == sp.eos_id() and tok.pad_id == tok.eos_id
    assert tok.doc()["source"]["sha256"] == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert load_tokenizer(path).sha256 == tok.sha256  # the conversion is deterministic
    # A folder holding tokenizer.model (and a config naming the chat template) loads the same way.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(path.read_bytes())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}"})
    )
    again = load_tokenizer(folder)
    assert again.sha256 == tok.sha256 and again.render_chat([{"role": "user", "content": "hi"}]) == "hi"


def test_corrupt_or_unsupported_sentencepiece_files_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = {
        "png.model": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xff",
        "empty.model": b"",
        "text.model": b"this is not a protobuf at all\n" * 10,
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"{name} is not a valid SentencePiece model") as err:
            load_tokenizer(tmp_path / name)
        assert "\n" not in str(err.value)
    good = train_spm(tmp_path / "good.model")
    cut = tmp_path / "cut.model"
    cut.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(ConfigError, match=r"cut\.model is not a valid SentencePiece model"):
        load_tokenizer(cut)
    char = train_spm(tmp_path / "char.model", "char", byte_fallback=False)
    with pytest.raises(ConfigError, match="is a SentencePiece char model; gpuyard reads unigram and BPE"):
        load_tokenizer(char)
    monkeypatch.setattr(tokenizer_mod, "MAX_SENTENCEPIECE_BYTES", 1000)
    with pytest.raises(ConfigError, match=r"bytes is too large for a tokenizer \(at most 1000\)"):
        load_tokenizer(good)


def test_tokenize_with_a_sentencepiece_model_records_both_hashes(gpuyard_home: Path, tmp_path: Path) -> None:
    path = train_spm(tmp_path / "sp.model", "bpe")
    docs = corpus(40)
    docs[3] += " </s> not a boundary"
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    text = ingest_text(src, "spcorpus")
    tv = tokenize(text.ref, path, seq_len=32)
    info = tv.manifest["tokens"]
    tok = load_tokenizer(path)
    assert info["tokenizer"]["sha256"] == tok.sha256 and info["tokenizer"]["source"] == tok.source
    assert tokenizer_bytes(tv) == tok.raw  # the stored tokenizer is the converted tokenizer.json
    assert info["tokens"] == sum(len(i) + 1 for i in tok.encode_batch(docs))
    # "</s>" spelled inside a document is text, not the end-of-sequence token.
    forged = tok.encode_batch([docs[3]])[0]
    assert tok.eos_id not in forged and len(forged) > len(tok.encode_batch([corpus(40)[3]])[0]) + 1


def test_a_model_with_only_tokenizer_model_exports_and_registers_its_conversion(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    """A Hugging Face folder whose tokenizer is a SentencePiece ``tokenizer.model`` (no tokenizer.json):
    an export and a registered version keep the checked conversion, so the tokenizer is not lost."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from gpuyard.models.llm import fetch_lm, register_lm
    from gpuyard.train.hf import write_tokenizer

    spm = train_spm(tmp_path / "sp.model")
    tok = load_tokenizer(spm)
    out = tmp_path / "export"
    out.mkdir()
    write_tokenizer(spm, out)  # a .model file: converted, never copied as if it were JSON
    assert (out / "tokenizer.json").read_bytes() == tok.raw

    folder = tmp_path / "model"
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=64)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(spm.read_bytes())
    mv = register_lm("spm-lm", folder)
    assert mv.config["tokenizer_sha256"] == tok.sha256 and "tokenizer.json" in mv.files
    fetched = fetch_lm("spm-lm:1")
    assert load_tokenizer(fetched).sha256 == tok.sha256
    text = "a cat saw the dog"
    assert AutoTokenizer.from_pretrained(fetched).decode(tok.encode_batch([text])[0]).strip() == text
