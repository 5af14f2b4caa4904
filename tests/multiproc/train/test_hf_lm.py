"""Hugging Face causal LMs on gpuyard's trainer: packed sequences, FSDP2 and tensor parallelism on 2
ranks (one launch), exact validation perplexity, export in Hugging Face layout that transformers opens,
LoRA adapters registered and merged."""

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
from tests.llm_fixtures import token_dataset

pytestmark = pytest.mark.multiproc


def tiny_llama(folder: Path, vocab: int, ctx: int = 64, tie: bool = False) -> Path:
    """A Llama config.json: hidden 32, 2 layers, 4 heads (2 key/value heads: GQA)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": ctx, "tie_word_embeddings": tie, "eos_token_id": 0, "pad_token_id": 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json"


def _spec(tmp: Path, model: dict[str, Any], data: str, val: bool = True, **fields: Any) -> Path:
    """A train spec in ``tmp`` (run folder ``tmp/run``); ``val``: with the val split as validation data."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {
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
    if not val:
        del spec["data"]["val"]
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def tokens(gpuyard_home: Path, tmp_path: Path) -> tuple[str, Path]:
    return token_dataset(tmp_path, 160, val_fraction=0.2)


LAYER0 = "hf.model.layers.0"  # the first decoder layer's parameter names in gpuyard's CausalLM


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in rows if x.get("event") == "metrics" and "step_time" in x]


def test_two_ranks_fsdp_and_tensor_parallel_train_and_export(
    tmp_path: Path, tokens: tuple[str, Path]
) -> None:
    """One launch of 2 ranks trains twice: FSDP2 (dp=2) and tensor parallel (tp=2, tied embeddings)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuyard.data.tokens import load_tokenizer
    from gpuyard.models.llm import evaluate_lm, fetch_lm, register_lm
    from gpuyard.train.spec import load_spec
    from gpuyard.train.trainer import Trainer

    ref, tok_folder = tokens
    vocab = load_tokenizer(tok_folder).vocab_size
    fsdp = _spec(
        tmp_path / "fsdp", {"config": str(tiny_llama(tmp_path / "cfg", vocab)), "samples": {"count": 1}},
        ref, max_steps=4, val_every_steps=2, parallel={"data_parallel": "fsdp"},
    )  # fmt: skip
    # Tensor parallel: tied embeddings (replicated; the head is the embedding), clipping over DTensor
    # gradients, no validation; the same spec on one process is the reference.
    tied = {"config": str(tiny_llama(tmp_path / "tied", vocab, tie=True))}
    tp_fields: dict[str, Any] = {"max_steps": 3, "clip_grad_norm": 1.0, "val": False}
    tp2 = _spec(tmp_path / "tp2", tied, ref, parallel={"tp": 2}, **tp_fields)
    tp1 = _spec(tmp_path / "tp1", tied, ref, **tp_fields)
    script = Path(__file__).with_name("hf_lm_ranks.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run([*cmd, str(fsdp), str(tp2)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # FSDP2 over 2 ranks: trained, validated, exported.
    run = tmp_path / "fsdp" / "run"
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "completed" and status["step"] == 4
    shards = json.loads((run / "shards.json").read_text())
    q = shards[f"{LAYER0}.self_attn.q_proj.weight"]
    assert shards["layout"] == [1, 2, 1] and q["dtensor"] and q["local"] == [16, 32] and q["full"] == [32, 32]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x.get("metrics", x) and "tokens_per_s" in x.get("metrics", x)]
    assert train and all(x.get("metrics", x)["tokens_per_s"] > 0 for x in train)
    ppl = [x.get("metrics", x) for x in lines if "val_perplexity" in x.get("metrics", x)]
    assert len(ppl) >= 2 and ppl[-1]["val_perplexity"] < ppl[0]["val_perplexity"] < vocab
    exported = run / "hf"
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

    # Tensor parallel over 2 ranks: each rank holds half the heads and half the MLP (column-wise q,
    # row-wise o), and the run is the one-process run of the same spec: the same losses step by
    # step, the same weights in the export (gathered from the shards), the same greedy generations.
    tp_run = tmp_path / "tp2" / "run"
    assert json.loads((tp_run / "status.json").read_text())["status"] == "completed"
    shards = json.loads((tp_run / "shards.json").read_text())
    q, o = shards[f"{LAYER0}.self_attn.q_proj.weight"], shards[f"{LAYER0}.self_attn.o_proj.weight"]
    assert shards["layout"] == [1, 1, 2] and q["local"] == [16, 32] and o["local"] == [32, 16]
    assert not shards["hf.model.embed_tokens.weight"]["dtensor"]
    assert "hf.lm_head.weight" not in shards  # tied: the same parameter as the embedding
    single = Trainer(load_spec(tp1))
    assert single.fit().status == "completed"
    want, got = _losses(tmp_path / "tp1" / "run"), _losses(tp_run)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5) and got[-1] < got[0]
    a = load_file(tmp_path / "tp1" / "run" / "hf" / "model.safetensors")
    b = load_file(tp_run / "hf" / "model.safetensors")
    # Tensor parallel sums each row's products in two halves, the one-process run in one: after three
    # Adam steps the weights differ by float32 rounding (up to 1.1e-5 seen on this CPU), never more.
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=5e-5) for k in a)
    prompt = hf_tok("the cat sat on", return_tensors="pt")
    outs = [
        AutoModelForCausalLM.from_pretrained(folder).generate(**prompt, max_new_tokens=12, do_sample=False)
        for folder in (tmp_path / "tp1" / "run" / "hf", tp_run / "hf")
    ]
    assert torch.equal(outs[0], outs[1])


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


def test_cpu_attention_equals_eager_attention_on_packed_sequences(tmp_path: Path) -> None:
    """The trainer's default attention (float32 flash with GQA in place on the CPU) computes what
    transformers' eager attention does on packed documents, forward and backward, in fp32 and bf16."""
    from gpuyard.train.hf import GPUYARD_SDPA, causal_lm

    cfg = str(tiny_llama(tmp_path, vocab=40))
    torch.manual_seed(0)
    ours = causal_lm(config=cfg)
    eager = causal_lm(config=cfg, attn_implementation="eager")
    eager.load_state_dict(ours.state_dict())
    assert ours.hf.config._attn_implementation == GPUYARD_SDPA
    ids = torch.randint(2, 40, (2, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two documents a row
    batch = {"input_ids": ids, "position_ids": pos}
    for model in (ours, eager):
        model(batch).float().square().mean().backward()
    assert torch.allclose(ours(batch), eager(batch), atol=1e-5)
    q = "hf.model.layers.0.self_attn.k_proj.weight"
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert torch.allclose(grads[q], dict(eager.named_parameters())[q].grad, atol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low, ref = ours(batch).float(), eager(batch).float()
    assert (low - ref).abs().max() < 0.05
    # No attention across the boundary: the second document alone gives its packed logits.
    alone = ours({"input_ids": ids[:, 10:], "position_ids": pos[:, 10:]})
    assert torch.allclose(alone, ours(batch)[:, 10:], atol=1e-5)
