"""Transformer shapes for the step model: presets of published models, or a YAML/JSON file.

A file holds ``layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq_len`` and optionally
``gated_mlp`` (SwiGLU: three FFN matrices), ``tied_embeddings``, ``head_size`` (where heads x head width
is not the hidden width), multi-head latent attention (``kv_lora_rank``, ``q_lora_rank``,
``rope_head_dim``, ``v_head_dim``), and for mixture-of-experts models ``dense_layers`` /
``dense_ffn_hidden`` (leading layers with a dense FFN) and
``experts`` and ``top_k`` (every layer's FFN becomes ``experts`` FFNs of width ``ffn_hidden``, each
token routed to ``top_k`` of them), ``shared_experts`` (FFNs of the same width every token passes through,
as in DeepSeek-MoE / DeepSeek-V3), and how unevenly tokens reach the experts: ``capacity_factor``
(token-dropping routers that pad every expert to ``capacity_factor`` x its balanced share, e.g.
Megatron's ``--moe-expert-capacity-factor``) or, for dropless routing, ``load_imbalance`` (the busiest
expert-parallel rank's routed tokens over the balanced share: that rank sets the pace).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache
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
        head_size: width of one attention head where it is not hidden / heads (Qwen3: 128 x 64 heads
            on a 4096-wide model); 0: hidden / heads. Under MLA, the non-positional part of a query/key head.
        dense_layers: the first layers of a mixture-of-experts model that keep a dense FFN of width
            ``dense_ffn_hidden`` (DeepSeek-V3: 3 of 61); the other layers are MoE with expert width
            ``ffn_hidden``.
        dense_ffn_hidden: FFN width of those dense layers.
        q_lora_rank, kv_lora_rank, rope_head_dim, v_head_dim: multi-head latent attention (DeepSeek-V2/V3):
            queries and keys/values pass through low-rank latents of these widths (kv_lora_rank > 0
            turns MLA on; q_lora_rank 0 projects queries directly), each query/key head adds a
            ``rope_head_dim`` positional part, each value head is ``v_head_dim`` wide.
        dropout: the model's dropout rate in training (memory: masks are kept only where it is above 0);
            None: the software stack's default (``Stack.dropout``).
        route_nodes: node-limited routing: each token goes to experts on at most this many nodes and
            crosses the network once per target node (DeepSeek-V3: 4); 0: unlimited.
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
    head_size: int = 0
    dense_layers: int = 0
    dense_ffn_hidden: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    dropout: float | None = None
    route_nodes: int = 0

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
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """Width of one attention head (under MLA: of a query/key head's non-positional part)."""
        return self.head_size or self.hidden // self.heads

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head (MLA adds the positional part)."""
        return self.head_dim + self.rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """Width of one value head."""
        return self.v_head_dim or self.head_dim

    @cached_property
    def attention_width(self) -> float:
        """heads x (query/key + value head width) / 2: the hidden width for plain multi-head attention.

        The score (Q K^T) and value (P V) products of one token against ``s`` keys cost
        ``2 s x attention_width`` FLOPs each way together, forward: causal kernels do half.
        """
        return self.heads * (self.qk_head_dim + self.value_head_dim) / 2

    def attention_gemms(self, tokens: float, tp: int) -> list[tuple[float, float, float]]:
        """(M, N, K) of one layer's attention projections on one of ``tp`` tensor-parallel ranks.

        MLA's down-projections into the latents are small and replicated on every rank (as in
        Megatron-Core's MLA); the up-projections and the output projection are split by heads.
        """
        h, heads = float(self.hidden), self.heads
        out = (tokens, h, heads * self.value_head_dim / tp)
        if not self.is_mla:
            qkv = (heads + 2 * self.kv_heads) * self.head_dim
            return [(tokens, qkv / tp, h), out]
        shapes: list[tuple[float, float, float]] = []
        if self.q_lora_rank:
            shapes += [
                (tokens, self.q_lora_rank, h),
                (tokens, heads * self.qk_head_dim / tp, self.q_lora_rank),
            ]
        else:
            shapes.append((tokens, heads * self.qk_head_dim / tp, h))
        shapes.append((tokens, float(self.kv_lora_rank + self.rope_head_dim), h))
        up = heads * (self.head_dim + self.value_head_dim) / tp
        shapes += [(tokens, up, float(self.kv_lora_rank)), out]
        return shapes

    @cached_property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one block (MLA: its down- and up-projections)."""
        h, heads = self.hidden, self.heads
        out = heads * self.value_head_dim * h
        if not self.is_mla:
            return h * heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim + out
        q = h * self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim if self.q_lora_rank else 0
        q = q or h * heads * self.qk_head_dim
        kv = h * (self.kv_lora_rank + self.rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.head_dim + self.value_head_dim)
        return q + kv + out

    @property
    def ffn_params(self) -> int:
        """One FFN (one expert in a mixture-of-experts model)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts."""
        return self.layers - self.dense_layers if self.is_moe else 0

    def parts(self) -> list[tuple[float, ModelSpec]]:
        """(share of the layers, uniform model) for each kind of layer: one part unless some are dense.

        A mixture-of-experts model with ``dense_layers`` is a dense model on those layers and a uniform
        MoE model on the rest; per-layer figures (times, activations) average over the parts.
        """
        return _parts(self)

    def _split(self) -> list[tuple[float, ModelSpec]]:
        if not (self.is_moe and self.dense_layers):
            return [(1.0, self)]
        moe = replace(self, dense_layers=0, dense_ffn_hidden=0)
        dense = replace(
            moe, experts=0, top_k=1, shared_experts=0, capacity_factor=None, ffn_hidden=self.dense_ffn_hidden
        )
        return [(self.dense_layers / self.layers, dense), (self.moe_layers / self.layers, moe)]

    def _per_layer(self, moe_block: int) -> float:
        """Average over the layers of a per-layer figure that the dense layers lack."""
        return moe_block * self.moe_layers / self.layers

    @cached_property
    def shared_params(self) -> float:
        """The shared experts of one block (dense: every token passes through them), per layer on average."""
        return self._per_layer(self.shared_experts * self.ffn_params) if self.is_moe else 0

    @cached_property
    def expert_params(self) -> float:
        """All routed experts of one block plus the router (0 for a dense model), per layer on average."""
        if not self.is_moe:
            return 0
        return self._per_layer(self.experts * self.ffn_params + self.experts * self.hidden)

    @cached_property
    def _dense_ffn(self) -> float:
        """The dense layers' FFN parameters, per layer on average."""
        if not self.dense_layers:
            return 0
        width = (3 if self.gated_mlp else 2) * self.hidden * self.dense_ffn_hidden
        return width * self.dense_layers / self.layers

    @cached_property
    def active_layer_params(self) -> float:
        """Parameters one token passes through in a block (top_k experts and the router for MoE)."""
        if not self.is_moe:
            return self.layer_params
        routed = self._per_layer(self.top_k * self.ffn_params + self.experts * self.hidden)
        return self.attention_params + self.shared_params + routed + self._dense_ffn

    @cached_property
    def layer_params(self) -> float:
        """Parameters of one block (attention + FFN or all experts; norms and biases are negligible).

        With dense layers in a mixture-of-experts model, the average over the layers.
        """
        if self.is_moe:
            return self.attention_params + self.shared_params + self.expert_params + self._dense_ffn
        return self.attention_params + self.ffn_params

    @property
    def embedding_params(self) -> int:
        """Embedding and output-projection parameters."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameters."""
        return round(self.layers * self.layer_params) + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (embeddings included, as published active counts do)."""
        return round(self.layers * self.active_layer_params) + self.embedding_params

    def model_flops_per_token(self, seq_len: int, causal: bool = False) -> float:
        """Training FLOPs per token (forward + backward, no recomputation), PaLM's MFU convention.

        ``6 x (block + output-projection parameters) + 12 x layers x hidden x seq_len``: the attention
        term counts the full score matrix, as PaLM and Megatron do; ``causal=True`` counts half of it
        (the products a causal kernel really performs), as some reports do.
        """
        dense = self.layers * self.active_layer_params + self.vocab * self.hidden
        return 6.0 * dense + (6.0 if causal else 12.0) * self.layers * self.attention_width * seq_len

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form with the parameter count."""
        return {**asdict(self), "params": self.params, "active_params": self.active_params}


@lru_cache(maxsize=256)
def _parts(model: ModelSpec) -> list[tuple[float, ModelSpec]]:
    return model._split()


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
    # DeepSeek-V3: DeepSeek-AI 2024 (arXiv:2412.19437, section 4.2) and deepseek-ai/DeepSeek-V3
    # config.json: 61 layers, hidden 7168, 128 heads of MLA (q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope 128 + qk_rope 64, v_head_dim 128); the first 3 layers dense (intermediate 18432), the other 58
    # with 1 shared + 256 routed experts of 2048, top-8; vocabulary 129280, untied; 4K pre-training
    # context. 671B parameters, 37B active (the multi-token-prediction module's 14B not counted).
    "deepseek-v3": ModelSpec(
        "deepseek-v3",
        61,
        7168,
        128,
        128,
        2048,
        129280,
        4096,
        gated_mlp=True,
        experts=256,
        top_k=8,
        shared_experts=1,
        head_size=128,
        dense_layers=3,
        dense_ffn_hidden=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        v_head_dim=128,
        route_nodes=4,  # "each token will be sent to at most 4 nodes" (section 4.2)
    ),
    # Qwen3-MoE: Qwen team 2025 (arXiv:2505.09388, Table 2) and Qwen/Qwen3-235B-A22B, Qwen/Qwen3-30B-A3B
    # config.json: 94 (48) layers, hidden 4096 (2048), 64 (32) query heads of 128 with 4 KV heads (so
    # heads x head_dim != hidden), 128 experts of 1536 (768), top-8, no shared expert, vocabulary 151936,
    # untied; 4K context in the first pre-training stage. 235B / 22B and 30.5B / 3.3B active.
    "qwen3-235b-a22b": ModelSpec(
        "qwen3-235b-a22b",
        94,
        4096,
        64,
        4,
        1536,
        151936,
        4096,
        gated_mlp=True,
        experts=128,
        top_k=8,
        head_size=128,
    ),
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b",
        48,
        2048,
        32,
        4,
        768,
        151936,
        4096,
        gated_mlp=True,
        experts=128,
        top_k=8,
        head_size=128,
    ),
}
# These architectures train without dropout whatever the framework's default: their released configs set
# attention dropout 0.0 and have no hidden dropout (Hugging Face LlamaConfig, MixtralConfig,
# DeepseekV3Config, Qwen3MoeConfig: attention_dropout 0.0), and Meta's Llama 3 reference model has none.
for _name in ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "mixtral-8x22b", "deepseek-v3",
              "qwen3-235b-a22b", "qwen3-30b-a3b"):  # fmt: skip
    PRESETS[_name] = replace(PRESETS[_name], dropout=0.0)


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
    head_size: int = Field(default=0, ge=0)
    dense_layers: int = Field(default=0, ge=0)
    dense_ffn_hidden: int = Field(default=0, ge=0)
    q_lora_rank: int = Field(default=0, ge=0)
    kv_lora_rank: int = Field(default=0, ge=0)
    rope_head_dim: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)
    dropout: float | None = Field(default=None, ge=0, lt=1)
    route_nodes: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerShape:
        kv = self.kv_heads or self.heads
        if (self.hidden % self.heads and not self.head_size) or self.heads % kv:
            raise ValueError(
                f"heads={self.heads} must divide hidden={self.hidden} (or give head_size) and be a "
                f"multiple of kv_heads={kv}"
            )
        if self.dense_layers and (
            not self.experts or not self.dense_ffn_hidden or self.dense_layers >= self.layers
        ):
            raise ValueError(
                "dense_layers needs a mixture-of-experts model (experts > 0), dense_ffn_hidden, and fewer "
                f"dense layers than layers ({self.layers})"
            )
        if (self.q_lora_rank or self.rope_head_dim or self.v_head_dim) and not self.kv_lora_rank:
            raise ValueError(
                "q_lora_rank, rope_head_dim and v_head_dim are MLA fields: give kv_lora_rank too"
            )
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if not self.experts and (self.shared_experts or self.capacity_factor is not None or self.route_nodes):
            raise ValueError(
                "shared_experts, capacity_factor and route_nodes need a mixture-of-experts model "
                "(experts > 0)"
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
            self.head_size,
            self.dense_layers,
            self.dense_ffn_hidden,
            self.q_lora_rank,
            self.kv_lora_rank,
            self.rope_head_dim,
            self.v_head_dim,
            self.dropout,
            self.route_nodes,
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
