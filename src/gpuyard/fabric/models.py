"""Transformer shapes for the step model: presets of published models, or a YAML/JSON file.

A file holds ``layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq_len`` and optionally
``gated_mlp`` (SwiGLU: three FFN matrices), ``tied_embeddings``, and for mixture-of-experts models
``experts`` and ``top_k`` (every layer's FFN becomes ``experts`` FFNs of width ``ffn_hidden``, each
token routed to ``top_k`` of them), ``shared_experts`` (FFNs of the same width every token passes through,
as in DeepSeek-MoE / DeepSeek-V3), and how unevenly tokens reach the experts: ``capacity_factor``
(token-dropping routers that pad every expert to ``capacity_factor`` x its balanced share, e.g.
Megatron's ``--moe-expert-capacity-factor``) or, for dropless routing, ``load_imbalance`` (the busiest
expert-parallel rank's routed tokens over the balanced share: that rank sets the pace).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpuyard.errors import ConfigError, NotFoundError
from gpuyard.textfiles import parse_yaml, read_text


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    Attributes:
        name: preset or file name.
        layers: transformer blocks.
        hidden: model width h.
        heads: attention (query) heads a.
        kv_heads: key/value heads (grouped-query attention when below ``heads``).
        ffn_hidden: FFN inner width f.
        vocab: vocabulary size V.
        seq_len: default training sequence length s.
        gated_mlp: SwiGLU-style FFN with three matrices (Llama) instead of two (GPT).
        tied_embeddings: input embedding and output projection share weights (GPT-3, Megatron).
        experts: FFN experts per layer (0 = dense model).
        top_k: experts each token is routed to.
        shared_experts: FFNs every token passes through besides its routed ones (0 for most models).
        capacity_factor: token-dropping routing: each expert computes capacity_factor x its balanced
            share of tokens (padded); None: dropless.
        load_imbalance: dropless routing: the busiest expert-parallel rank's routed tokens over the
            balanced share (>= 1; with ep = 1 every expert is local and it costs nothing).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 1
    shared_experts: int = 0
    capacity_factor: float | None = None
    load_imbalance: float = 1.0

    def expert_rows_factor(self, ep: int) -> float:
        """Routed rows the busiest expert-parallel rank computes over its balanced share."""
        if not self.is_moe:
            return 1.0
        if self.capacity_factor is not None:  # every expert is padded to its capacity
            return self.capacity_factor
        return self.load_imbalance if ep > 1 else 1.0

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.experts > 0

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one block."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def ffn_params(self) -> int:
        """One FFN (one expert in a mixture-of-experts model)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    @property
    def shared_params(self) -> int:
        """The shared experts of one block (dense: every token passes through them)."""
        return self.shared_experts * self.ffn_params if self.is_moe else 0

    @property
    def expert_params(self) -> int:
        """All routed experts of one block plus the router (0 for a dense model)."""
        return self.experts * self.ffn_params + self.experts * self.hidden if self.is_moe else 0

    @property
    def active_layer_params(self) -> int:
        """Parameters one token passes through in a block (top_k experts and the router for MoE)."""
        if not self.is_moe:
            return self.layer_params
        routed = self.top_k * self.ffn_params + self.experts * self.hidden
        return self.attention_params + self.shared_params + routed

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Parameters of one block (attention + FFN or all experts; norms and biases are negligible)."""
        if self.is_moe:
            return self.attention_params + self.shared_params + self.expert_params
        return self.attention_params + self.ffn_params

    @property
    def embedding_params(self) -> int:
        """Embedding and output-projection parameters."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameters."""
        return self.layers * self.layer_params + self.embedding_params

    def model_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward, no recomputation), PaLM's MFU convention.

        ``6 x (block + output-projection parameters) + 12 x layers x hidden x seq_len``: the attention
        term counts the full score matrix, as PaLM and Megatron do; ``causal=True`` counts half of it
        (the products a causal kernel really performs), as some reports do.
        """
        dense = self.layers * self.active_layer_params + self.vocab * self.hidden
        return 6.0 * dense + (6.0 if causal else 12.0) * self.layers * self.hidden * seq_len

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form with the parameter count."""
        return {**asdict(self), "params": self.params}


# Shapes from the papers and released configs named on each line.
PRESETS: dict[str, ModelSpec] = {
    # GPT-3 175B: Brown et al. 2020, Table 2.1 (96 x 12288, 96 heads, 2048 ctx); Megatron's 51,200 vocab.
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 96, 49152, 51200, 2048, tied_embeddings=True),
    # Megatron-LM weak-scaling models: Narayanan et al. SC'21, Table 1.
    "gpt-145b": ModelSpec("gpt-145b", 80, 12288, 96, 96, 49152, 51200, 2048, tied_embeddings=True),
    "gpt-1t": ModelSpec("gpt-1t", 128, 25600, 160, 160, 102400, 51200, 2048, tied_embeddings=True),
    # MT-NLG 530B: Smith et al. 2022 (105 layers, hidden 20480, 128 heads, 2048 ctx).
    "mt-nlg-530b": ModelSpec("mt-nlg-530b", 105, 20480, 128, 128, 81920, 51200, 2048, tied_embeddings=True),
    # BLOOM 176B: BigScience 2022 (70 layers, hidden 14336, 112 heads, 250,880 vocab, 2048 ctx).
    "bloom-176b": ModelSpec("bloom-176b", 70, 14336, 112, 112, 57344, 250880, 2048, tied_embeddings=True),
    # Llama 3: Dubey et al. 2024, Table 3 (GQA with 8 KV heads, SwiGLU, 128K vocab, 8K pre-training ctx).
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, gated_mlp=True),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, gated_mlp=True),
    # Mixtral 8x7B: Jiang et al. 2024 (32 layers, hidden 4096, 8 experts of 14336, top-2, 32K vocab).
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, gated_mlp=True, experts=8, top_k=2
    ),
    # Mixtral 8x22B: Mistral AI's released config (mistralai/Mixtral-8x22B-Instruct-v0.1 config.json: 56
    # layers, hidden 6144, 48 heads, 8 KV heads, 8 experts of 16384, top-2, vocabulary 32768, 64K context);
    # 141B parameters, 39B active (Mistral AI's announcement).
    "mixtral-8x22b": ModelSpec(
        "mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536, gated_mlp=True, experts=8, top_k=2
    ),
}


class TransformerShape(BaseModel):
    """A transformer's shape as users write it (model files, the published corpus), checked on parse."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int | None = Field(default=None, gt=0)
    ffn_hidden: int = Field(gt=0)
    vocab: int = Field(gt=0)
    gated_mlp: bool = False
    tied_embeddings: bool = False
    experts: int = Field(default=0, ge=0)
    top_k: int = Field(default=1, ge=1)
    shared_experts: int = Field(default=0, ge=0)
    capacity_factor: float | None = Field(default=None, gt=0)
    load_imbalance: float = Field(default=1.0, ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerShape:
        kv = self.kv_heads or self.heads
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} and be a multiple of kv_heads={kv}"
            )
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if not self.experts and (self.shared_experts or self.capacity_factor is not None):
            raise ValueError(
                "shared_experts and capacity_factor need a mixture-of-experts model (experts > 0)"
            )
        return self

    def spec(self, name: str, seq_len: int) -> ModelSpec:
        """The step model's ModelSpec for this shape at ``seq_len``."""
        return ModelSpec(
            name,
            self.layers,
            self.hidden,
            self.heads,
            self.kv_heads or self.heads,
            self.ffn_hidden,
            self.vocab,
            seq_len,
            self.gated_mlp,
            self.tied_embeddings,
            self.experts,
            self.top_k,
            self.shared_experts,
            self.capacity_factor,
            self.load_imbalance,
        )


class _ModelFile(TransformerShape):
    name: str | None = None
    seq_len: int = Field(gt=0)


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name or a model file (YAML/JSON).

    Raises:
        NotFoundError: neither a preset nor a file; the message lists the presets.
        ConfigError: the file is unreadable, a field is invalid, or the heads do not divide the width.
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path).expanduser()
    if not (path.suffix in (".yaml", ".yml", ".json") and path.is_file()):
        raise NotFoundError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a YAML/JSON file"
        )
    try:
        text = read_text(path, "model file")
        raw = json.loads(text) if path.suffix == ".json" else parse_yaml(text, path)
        data = _ModelFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{path}: {f'field {where!r}: ' if where else ''}{message}") from None
    except ValueError as exc:  # JSON
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    return data.spec(data.name or path.stem, data.seq_len)
