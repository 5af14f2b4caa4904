"""The exported Hugging Face folder generates fast and stops where a reply ends: generation_config.json
has use_cache true and the end-of-sequence list (eos, then the chat template's turn markers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.llm_fixtures import corpus

from gpuyard.data.tokenizer_train import train_tokenizer
from gpuyard.data.tokens import load_tokenizer
from gpuyard.train.hf import causal_lm, save_hf

pytestmark = pytest.mark.unit

TINY = {
    "model_type": "llama", "vocab_size": 260, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 64, "eos_token_id": 0, "pad_token_id": 1, "use_cache": False,
}  # fmt: skip


def test_export_generates_with_the_cache_and_stops_at_turn_markers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

    markers = ("<|system|>", "<|user|>", "<|assistant|>", "<|unused|>")
    tok_dir = train_tokenizer(corpus(200), tmp_path / "tok", vocab_size=260, extra_tokens=markers)
    tok = load_tokenizer(tok_dir)
    ids = {m: tok.tokenizer.token_to_id(m) for m in markers}
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model = causal_lm(config=str(tmp_path / "config.json"))
    out = save_hf(model, None, tmp_path / "hf", tok_dir)
    gen = json.loads((out / "generation_config.json").read_text())
    # eos first, then the markers the template writes; a special token it never writes is not one.
    assert gen["use_cache"] is True
    assert gen["eos_token_id"] == [tok.eos_id, ids["<|system|>"], ids["<|user|>"], ids["<|assistant|>"]]
    assert gen["pad_token_id"] == tok.pad_id
    assert GenerationConfig.from_pretrained(out).use_cache is True
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.generation_config.eos_token_id == gen["eos_token_id"]

    class ForceAt(LogitsProcessor):
        """Greedy picks <|unused|> twice, then <|user|> (a new turn): generation must end there."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step = input_ids.shape[1] - prompt.shape[1]
            scores[:] = -1e9
            scores[:, ids["<|unused|>"] if step < 2 else ids["<|user|>"]] = 0.0
            return scores

    prompt = torch.tensor([tok.encode_batch(["<|user|>\nhi\n<|assistant|>\n"], specials=True)[0]])
    done = hf.generate(
        prompt, max_new_tokens=20, do_sample=False, logits_processor=LogitsProcessorList([ForceAt()])
    )
    assert done[0, prompt.shape[1] :].tolist() == [ids["<|unused|>"], ids["<|unused|>"], ids["<|user|>"]]
