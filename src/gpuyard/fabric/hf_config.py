"""The planner's view of a Hugging Face model: ``config.json`` -> :class:`gpuyard.fabric.models.ModelSpec`.

Reads the JSON itself (no transformers import: planning stays fast). Llama, Qwen2/Qwen3, Mistral,
Gemma and their mixture-of-experts variants (Mixtral, Qwen-MoE) name their shape alike
(``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``); GPT-2 uses ``n_embd``/``n_layer``/``n_head``/``n_inner``. A gated MLP
(SwiGLU/GeGLU: three matrices) is every architecture's but GPT-2's; tied embeddings follow
``tie_word_embeddings`` (GPT-2: tied by default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuyard.errors import ConfigError
from gpuyard.fabric.models import ModelSpec, load_model

GPT2_TYPES = ("gpt2",)


def _int(doc: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for k in keys:
        v = doc.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise ConfigError(f"Hugging Face config: no positive integer {' / '.join(keys)}")


def spec_from_hf_config(doc: dict[str, Any], name: str = "hf-model", seq_len: int | None = None) -> ModelSpec:
    """The planner's ModelSpec of a Hugging Face ``config.json`` document.

    Raises:
        ConfigError: a field the shape needs is missing, or the heads do not divide the width.
    """
    kind = doc.get("model_type")
    if not isinstance(kind, str):
        raise ConfigError("Hugging Face config: no model_type")
    gpt2 = kind in GPT2_TYPES
    if gpt2:
        hidden = _int(doc, "n_embd", "hidden_size")
        layers = _int(doc, "n_layer", "num_hidden_layers")
        heads = _int(doc, "n_head", "num_attention_heads")
        kv = heads
        ffn = _int(doc, "n_inner", default=4 * hidden)
        context = _int(doc, "n_positions", "max_position_embeddings", default=1024)
        tied = bool(doc.get("tie_word_embeddings", True))
    else:
        hidden = _int(doc, "hidden_size")
        layers = _int(doc, "num_hidden_layers")
        heads = _int(doc, "num_attention_heads")
        kv = _int(doc, "num_key_value_heads", default=heads)
        experts = (
            _int(doc, "num_local_experts", "num_experts", "n_routed_experts", default=0)
            if any(k in doc for k in ("num_local_experts", "num_experts", "n_routed_experts"))
            else 0
        )
        ffn = (
            _int(doc, "moe_intermediate_size", "intermediate_size")
            if experts
            else _int(doc, "intermediate_size")
        )
        context = _int(doc, "max_position_embeddings", default=4096)
        tied = bool(doc.get("tie_word_embeddings", False))
    experts = 0 if gpt2 else experts
    top_k = _int(doc, "num_experts_per_tok", default=1) if experts else 1
    vocab = _int(doc, "vocab_size")
    extra: dict[str, int] = {}
    if not gpt2:
        extra = _shape_extras(doc, hidden, heads, layers, experts)
    if (hidden % heads and not extra.get("head_size")) or heads % kv:
        raise ConfigError(
            f"Hugging Face config: heads={heads} must divide hidden={hidden} and kv_heads={kv} heads"
        )
    # The config's dropout rates (GPT-2: attn_pdrop / resid_pdrop, 0.1 by default; Llama-style:
    # attention_dropout, 0.0): masks are kept in training only where one is above 0. None: not stated.
    rates = [doc[k] for k in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop") if k in doc]
    if any(not isinstance(r, int | float) or isinstance(r, bool) or not 0 <= r < 1 for r in rates):
        raise ConfigError(f"Hugging Face config: dropout rates must be numbers in [0, 1), got {rates}")
    return ModelSpec(
        name, layers, hidden, heads, kv, ffn, vocab, seq_len or context,
        gated_mlp=not gpt2, tied_embeddings=tied, experts=experts, top_k=top_k, **extra,
        dropout=float(max(rates)) if rates else (0.1 if gpt2 else None),
    )  # fmt: skip


def _shape_extras(doc: dict[str, Any], hidden: int, heads: int, layers: int, experts: int) -> dict[str, int]:
    """head_dim, shared experts, leading dense layers and MLA fields of a (non-GPT-2) config.

    Raises:
        ConfigError: a layer pattern ModelSpec cannot express (MoE on only some layers other than
            the first ones).
    """
    out: dict[str, int] = {}
    if "kv_lora_rank" in doc:  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
        out["kv_lora_rank"] = _int(doc, "kv_lora_rank")
        out["q_lora_rank"] = doc["q_lora_rank"] if isinstance(doc.get("q_lora_rank"), int) else 0
        out["rope_head_dim"] = _int(doc, "qk_rope_head_dim")
        out["head_size"] = _int(doc, "qk_nope_head_dim")
        out["v_head_dim"] = _int(doc, "v_head_dim")
    elif isinstance(doc.get("head_dim"), int) and doc["head_dim"] * heads != hidden:
        out["head_size"] = _int(doc, "head_dim")
    if not experts:
        return out
    if isinstance(doc.get("n_shared_experts"), int) and doc["n_shared_experts"] > 0:
        out["shared_experts"] = doc["n_shared_experts"]
    # Group-limited routing (DeepSeek-V3: n_group 8, topk_group 4): each token's experts come from at
    # most topk_group of n_group expert groups; DeepSeek places one group per node, so it is node-limited.
    groups, picked = doc.get("n_group"), doc.get("topk_group")
    if (
        type(groups) is int
        and type(picked) is int
        and groups > 1
        and 0 < picked < groups
        and experts % groups == 0
    ):
        out["route_nodes"] = picked
    dense = doc.get("first_k_dense_replace", 0)
    if isinstance(dense, int) and dense > 0:
        out["dense_layers"] = min(dense, layers - 1)
        out["dense_ffn_hidden"] = _int(doc, "intermediate_size")
    step = doc.get("decoder_sparse_step", doc.get("moe_layer_freq", 1))
    if step not in (None, 1) or doc.get("mlp_only_layers"):
        raise ConfigError(
            "Hugging Face config: MoE on only some layers (decoder_sparse_step / moe_layer_freq / "
            "mlp_only_layers) is not expressible; only leading dense layers (first_k_dense_replace) are"
        )
    return out


def load_hf_config(path: str | Path, seq_len: int | None = None) -> ModelSpec:
    """:func:`spec_from_hf_config` of a ``config.json`` file (or a folder holding one).

    Raises:
        ConfigError: unreadable, not JSON, or not a transformer shape.
    """
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        doc = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read ({exc.strerror})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{file}: not JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    try:
        return spec_from_hf_config(
            doc, file.parent.name if file.name == "config.json" else file.stem, seq_len
        )
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None


def load_any_model(name_or_path: str) -> ModelSpec:
    """A model preset, a gpuyard model file, or a Hugging Face ``config.json`` (or a folder holding
    one): what ``gpuyard plan --model`` and a job's ``workload.model`` accept.

    Raises:
        NotFoundError / ConfigError: as :func:`gpuyard.fabric.models.load_model` and
            :func:`load_hf_config`.
    """
    path = Path(name_or_path).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if config.suffix == ".json" and config.is_file():
        try:
            doc = json.loads(config.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            doc = None  # load_model says what is wrong with it
        if isinstance(doc, dict) and "model_type" in doc:
            return load_hf_config(config)
    return load_model(name_or_path)
