"""Hugging Face configs as the planner's ModelSpec: GQA, SwiGLU, tied embeddings, MoE, GPT-2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.fabric.hf_config import load_hf_config, spec_from_hf_config
from gpuyard.fabric.models import PRESETS

pytestmark = pytest.mark.unit

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


def test_llama_config_matches_the_preset_parameter_count(tmp_path: Path) -> None:
    spec = spec_from_hf_config(LLAMA3_8B, "llama3-8b")
    assert (spec.kv_heads, spec.gated_mlp, spec.tied_embeddings, spec.seq_len) == (8, True, False, 8192)
    if "llama3-8b" in PRESETS:
        assert spec.params == PRESETS["llama3-8b"].params
    assert 7.9e9 < spec.params < 8.1e9  # Llama 3 8B: 8.03B parameters (Meta's model card)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_hf_config(tmp_path / "m", seq_len=2048).seq_len == 2048


def test_gpt2_moe_and_bad_configs(tmp_path: Path) -> None:
    gpt2 = spec_from_hf_config(
        {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}
    )
    assert (gpt2.ffn_hidden, gpt2.gated_mlp, gpt2.tied_embeddings, gpt2.seq_len) == (3072, False, True, 1024)
    assert 120e6 < gpt2.params < 130e6  # GPT-2 small: 124M
    mixtral = spec_from_hf_config({
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
        "num_experts_per_tok": 2,
    })  # fmt: skip
    assert (mixtral.experts, mixtral.top_k) == (
        8,
        2,
    ) and 46e9 < mixtral.params < 47.5e9  # Mixtral 8x7B: 46.7B
    with pytest.raises(ConfigError, match="heads=5 must divide hidden=64"):
        spec_from_hf_config(
            {**LLAMA3_8B, "hidden_size": 64, "num_attention_heads": 5, "num_key_value_heads": 5}
        )
    with pytest.raises(ConfigError, match="no positive integer vocab_size"):
        spec_from_hf_config({k: v for k, v in LLAMA3_8B.items() if k != "vocab_size"})
    (tmp_path / "bin.json").write_bytes(b"\x00\xffbinary")
    with pytest.raises(ConfigError, match="not JSON"):
        load_hf_config(tmp_path / "bin.json")


def test_gpuyard_plan_takes_a_hugging_face_config_or_its_folder(tmp_path: Path) -> None:
    """`gpuyard plan --model config.json` plans the model the config describes (the model you train)."""
    import json

    from gpuyard.fabric.hf_config import load_any_model
    from gpuyard.fabric.models import load_model

    folder = tmp_path / "llama"
    folder.mkdir()
    preset = load_model("llama3-8b")
    doc = {
        "model_type": "llama",
        "hidden_size": preset.hidden,
        "num_hidden_layers": preset.layers,
        "num_attention_heads": preset.heads,
        "num_key_value_heads": preset.kv_heads,
        "intermediate_size": preset.ffn_hidden,
        "vocab_size": preset.vocab,
        "max_position_embeddings": 8192,
    }
    (folder / "config.json").write_text(json.dumps(doc))
    for ref in (str(folder), str(folder / "config.json")):
        spec = load_any_model(ref)
        assert (spec.layers, spec.hidden, spec.kv_heads) == (preset.layers, preset.hidden, preset.kv_heads)
    assert load_any_model("llama3-8b") == preset  # presets and model files as before
