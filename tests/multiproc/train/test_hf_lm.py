"""Hugging Face causal LMs on gpuyard's trainer: packed sequences, FSDP2 on 2 ranks, exact validation
perplexity, export in Hugging Face layout that transformers opens, LoRA adapters registered and merged."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tests.llm_fixtures import corpus, tokenizer_folder

pytestmark = pytest.mark.multiproc


def tiny_llama(folder: Path, vocab: int, ctx: int = 64) -> Path:
    """A Llama config.json: hidden 32, 2 layers, 4 heads (2 key/value heads: GQA)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": ctx, "tie_word_embeddings": False, "eos_token_id": 0, "pad_token_id": 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json"


def _spec(tmp: Path, model: dict[str, Any], data: str, **fields: Any) -> Path:
    spec = {
        "name": "lm",
        "run_dir": str(tmp / "run"),
        "model": {"entrypoint": "gpuyard.train.hf:causal_lm", "kwargs": model},
        "data": {
            "train": {
                "entrypoint": "gpuyard.data.tokens:packed_batches",
                "kwargs": {"dataset": data, "split": "train"},
            },
            "val": {
                "entrypoint": "gpuyard.data.tokens:packed_batches",
                "kwargs": {"dataset": data, "split": "val"},
            },
            "batch_size": 4,
        },
        "loss": "gpuyard.train.hf:lm_loss",
        "optimizer": {"lr": 0.01},
        "callbacks": ["gpuyard.train.hf:export_at_end"],
        "tracking": "jsonl",
        **fields,
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def tokens(gpuyard_home: Path, tmp_path: Path) -> tuple[str, Path]:
    from gpuyard.data.text import ingest_text
    from gpuyard.data.tokens import tokenize

    folder = tokenizer_folder(tmp_path)
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in corpus(160)))
    v = tokenize(ingest_text(src, "corpus").ref, folder, seq_len=32, val_fraction=0.2, seed=0)
    return v.ref, folder


def test_fsdp_two_ranks_train_export_and_perplexity(tmp_path: Path, tokens: tuple[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.models.llm import evaluate_lm, fetch_lm, register_lm

    ref, tok_folder = tokens
    vocab = load_tokenizer(tok_folder).vocab_size
    spec = _spec(
        tmp_path, {"config": str(tiny_llama(tmp_path / "cfg", vocab))}, ref,
        max_steps=6, val_every_steps=3, parallel={"data_parallel": "fsdp"},
    )  # fmt: skip
    cmd = [sys.executable, "-m", "gpuyard.cli.main", "train", str(spec), "--nproc", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stdout)
    assert status["status"] == "completed" and status["step"] == 6
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x.get("metrics", x) and "tokens_per_s" in x.get("metrics", x)]
    assert train and all(x.get("metrics", x)["tokens_per_s"] > 0 for x in train)
    ppl = [x.get("metrics", x) for x in lines if "val_perplexity" in x.get("metrics", x)]
    assert len(ppl) >= 2 and ppl[-1]["val_perplexity"] < ppl[0]["val_perplexity"] < vocab
    exported = tmp_path / "run" / "hf"
    info = json.loads((exported / "gpuyard.json").read_text())
    assert info["context_length"] == 32 and info["dataset"] == ref
    # The export is the trained model: transformers opens it and its perplexity on the same split,
    # counted exactly, is what training measured last (weights gathered from the FSDP shards).
    again = evaluate_lm(str(exported), ref, "val")
    assert again["val_tokens"] == ppl[-1]["val_tokens"]
    assert again["val_perplexity"] == pytest.approx(info["val_perplexity"], rel=1e-4)
    model = AutoModelForCausalLM.from_pretrained(exported)
    hf_tok = AutoTokenizer.from_pretrained(exported)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ).endswith("<|assistant|>\n")
    prompt = hf_tok("the cat sat", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8 or int(out[0, -1]) == hf_tok.eos_token_id
    # Registered with its tokenizer and context length; fetched back byte for byte.
    mv = register_lm("tiny", exported)
    assert mv.flavor == "causal-lm" and mv.config["context_length"] == 32
    assert mv.config["tokenizer_sha256"] == load_tokenizer(tok_folder).sha256
    assert (fetch_lm("tiny") / "model.safetensors").read_bytes() == (
        exported / "model.safetensors"
    ).read_bytes()


def test_lora_fine_tune_registers_an_adapter_that_merges(tmp_path: Path, tokens: tuple[str, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.errors import ConfigError
    from gpuyard.models.llm import fetch_lm, merge_adapter, promote_lm, register_lm
    from gpuyard.train.hf import causal_lm
    from gpuyard.train.spec import load_spec
    from gpuyard.train.trainer import Trainer

    ref, tok_folder = tokens
    vocab = load_tokenizer(tok_folder).vocab_size
    base_dir = tmp_path / "base"
    base = causal_lm(config=str(tiny_llama(tmp_path / "cfg", vocab)))
    from gpuyard.train.hf import save_hf

    save_hf(base, None, base_dir, tok_folder, {"context_length": 32})
    base_mv = register_lm("tiny", base_dir)
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec = load_spec(
        _spec(
            tmp_path,
            {"weights": str(fetch_lm("tiny:1")), "lora": lora},
            ref,
            max_steps=3,
            optimizer={"lr": 0.05},
        )
    )
    trainer = Trainer(spec)
    result = trainer.fit()
    assert result.status == "completed"
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    out = tmp_path / "run" / "hf"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    adapter = register_lm("tiny", out, base=base_mv.ref)
    assert adapter.flavor == "lora-adapter" and adapter.config["base"] == "tiny:1"
    # base + adapter (peft) and the merged export agree; and both differ from the base.
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    plain = AutoModelForCausalLM.from_pretrained(fetch_lm("tiny:1"))
    with torch.no_grad():
        base_logits = plain(ids).logits
        peft_logits = PeftModel.from_pretrained(plain, out / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(fetch_lm(adapter.ref))(ids).logits
    assert torch.allclose(peft_logits, merged, atol=1e-4) and not torch.allclose(
        base_logits, merged, atol=1e-3
    )
    full = merge_adapter(adapter.ref)
    assert full.flavor == "causal-lm" and full.version == 3
    # Promotion gated on perplexity: a gate below the model's perplexity refuses; a wide one promotes.
    refused = promote_lm(full.ref, ref, max_perplexity=1.0)
    assert not refused["promoted"] and "> the gate 1.0" in refused["reason"]
    ok = promote_lm(full.ref, ref, max_perplexity=10 * vocab)
    assert ok["promoted"] and math.isfinite(ok["perplexity"])
    with pytest.raises(ConfigError, match="give config"):
        causal_lm()
    (tmp_path / "bad.json").write_bytes(b"\x00\x01binary")
    with pytest.raises(ConfigError, match="is not JSON"):
        causal_lm(config=str(tmp_path / "bad.json"))
