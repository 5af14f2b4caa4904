"""The tensor-parallel plan of causal LMs with Llama-family layer names (train/hf.py) and accuracy
over labels with ignored positions (the packed language-model batches' -100).

The plan reads module names and the config's sizes only: a module tree named as transformers names a
Llama stands in for one here (building a real one imports transformers' model code, seconds); the
multiproc test trains a real Llama with the plan on 2 ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gpuyard.errors import ConfigError
from gpuyard.train.hf import CausalLM
from gpuyard.train.validation import accuracy_counts

pytestmark = pytest.mark.unit


def _llama_named(heads: int = 8, kv_heads: int = 2, mlp: int = 96, layers: int = 2) -> nn.Module:
    """Modules named as in transformers' LlamaForCausalLM (model.layers.N.self_attn.q_proj, ...)."""
    dim = 64

    def block() -> nn.Module:
        attn = nn.ModuleDict({k: nn.Linear(dim, dim) for k in ("q_proj", "k_proj", "v_proj", "o_proj")})
        up = {k: nn.Linear(dim, mlp) for k in ("gate_proj", "up_proj")}
        ffn = nn.ModuleDict({**up, "down_proj": nn.Linear(mlp, dim)})
        return nn.ModuleDict({"self_attn": attn, "mlp": ffn, "input_layernorm": nn.LayerNorm(dim)})

    root = nn.Module()
    root.model = nn.ModuleDict(
        {"embed_tokens": nn.Embedding(16, dim), "layers": nn.ModuleList(block() for _ in range(layers))}
    )
    root.lm_head = nn.Linear(dim, 16)
    root.config = SimpleNamespace(
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp
    )
    return root


def test_tp_plan_shards_llama_projections_and_refuses_uneven_splits() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = CausalLM(_llama_named()).tp_plan(tp=2)
    # 2 layers x (q, k, v, gate, up column-wise; o, down row-wise); embeddings, norms, head replicated.
    cols = sorted(k for k, v in plan.items() if isinstance(v, ColwiseParallel))
    rows = sorted(k for k, v in plan.items() if isinstance(v, RowwiseParallel))
    assert len(plan) == 14 and len(cols) == 10 and len(rows) == 4
    assert "hf.model.layers.1.self_attn.o_proj" in rows and "hf.model.layers.0.mlp.up_proj" in cols
    assert not any("embed" in k or "lm_head" in k or "norm" in k for k in plan)
    # 2 key/value heads do not split over 4 ranks (each rank would hold half a head).
    with pytest.raises(ConfigError, match=r"parallel.tp=4: the model's num_key_value_heads \(2\) does not"):
        CausalLM(_llama_named()).tp_plan(tp=4)
    with pytest.raises(ConfigError, match=r"intermediate_size \(97\) does not split over 2 ranks"):
        CausalLM(_llama_named(mlp=97)).tp_plan(tp=2)
    with pytest.raises(ConfigError, match="LoRA fine-tuning runs with dp only"):
        CausalLM(_llama_named(), lora=True).tp_plan(tp=2)
    other = nn.Module()
    other.transformer = nn.ModuleDict({"h": nn.ModuleList([nn.ModuleDict({"c_attn": nn.Linear(4, 12)})])})
    other.config = SimpleNamespace(num_attention_heads=2)
    with pytest.raises(ConfigError, match="has no Llama-style attention and MLP projections"):
        CausalLM(other).tp_plan(tp=2)


def test_accuracy_counts_leave_out_ignored_labels() -> None:
    scores = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])  # predicts 1, 0, 1, 0
    labels = torch.tensor([[1, 1, -100, -100]])
    assert accuracy_counts(scores, labels).tolist() == [1.0, 2.0]
