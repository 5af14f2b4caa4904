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
    if hidden % heads or heads % kv:
        raise ConfigError(
            f"Hugging Face config: heads={heads} must divide hidden={hidden} and kv_heads={kv} heads"
        )
    return ModelSpec(
        name, layers, hidden, heads, kv, ffn, vocab, seq_len or context,
        gated_mlp=not gpt2, tied_embeddings=tied, experts=experts, top_k=top_k,
    )  # fmt: skip


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
