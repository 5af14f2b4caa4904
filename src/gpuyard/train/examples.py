"""Small models and data for examples, tests and benchmarks (entrypoints a spec can name).

* :func:`mlp` - an ``nn.Sequential`` (pipeline parallel splits it into stages);
* :class:`TinyTransformer` - embedding, pre-norm blocks (attention + MLP), head; gives ``tp_plan()``
  for tensor parallel and ``fsdp_units()`` for FSDP2;
* :class:`SequentialTransformer` - the same layers as an ``nn.Sequential`` (embedding, blocks, head)
  with a ``tp_plan()``: pipeline stages of it can be tensor parallel (pp x tp);
* :func:`classification_data`, :func:`token_data` - seeded synthetic map-style datasets;
* :class:`TensorBatchLoader` - a loader following the resumable protocol (state_dict/load_state_dict/
  set_epoch), standing in for ``gpuyard.data.loader``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def mlp(
    in_features: int = 16, hidden: int = 32, out_features: int = 4, layers: int = 2, dropout: float = 0.0
) -> nn.Sequential:
    """A multi-layer perceptron as an nn.Sequential of Linear/ReLU/Dropout blocks."""
    mods: list[nn.Module] = []
    width = in_features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout:
            mods.append(nn.Dropout(dropout))
        width = hidden
    mods.append(nn.Linear(width, out_features))
    return nn.Sequential(*mods)


def classification_data(
    n: int = 512, in_features: int = 16, classes: int = 4, seed: int = 0, noise: float = 0.1
) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear map (learnable), seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    w = torch.randn(in_features, classes, generator=torch.Generator().manual_seed(1234))
    y = (x @ w + noise * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def token_data(n: int = 256, seq_len: int = 16, vocab: int = 32, seed: int = 0) -> TensorDataset:
    """Sequences counting up by a per-sequence stride (mod vocab); targets are the next tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


class Attention(nn.Module):
    """Causal self-attention; the head count follows the local width, so tensor parallel shards heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank holds dim/tp of q, k, v, i.e. heads/tp heads.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class TinyTransformer(nn.Module):
    """A small decoder-only language model for tests and benchmarks."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 16,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]

    def tp_plan(self) -> dict[str, Any]:
        """Megatron-style plan: q/k/v and fc1 split by columns, out and fc2 by rows (one all-reduce each)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i in range(len(self.blocks)):
            for name in ("attn.q", "attn.k", "attn.v", "fc1"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.out", "fc2"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan

    def fsdp_units(self) -> list[nn.Module]:
        """One FSDP2 unit per block."""
        return list(self.blocks)


class Embed(nn.Module):
    """Token embedding plus a learned position table (the first layer of a SequentialTransformer)."""

    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.pos[: tokens.shape[1]]  # type: ignore[no-any-return]


class Head(nn.Module):
    """Final norm and vocabulary projection (the last layer of a SequentialTransformer)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class SequentialTransformer(nn.Sequential):
    """A decoder as an nn.Sequential ``[Embed, Block x layers, Head]``: pipeline parallel splits it,
    and ``tp_plan()`` names paths (``"1.attn.q"``) that stay valid inside each stage."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 16,
        dropout: float = 0.0,
    ) -> None:
        blocks = [Block(dim, heads, dropout) for _ in range(layers)]
        super().__init__(Embed(vocab, dim, seq_len), *blocks, Head(vocab, dim))

    def tp_plan(self) -> dict[str, Any]:
        """Megatron-style plan per block, keyed by the block's position in the sequence."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i, layer in enumerate(self):
            if isinstance(layer, Block):
                for name in ("attn.q", "attn.k", "attn.v", "fc1"):
                    plan[f"{i}.{name}"] = ColwiseParallel()
                for name in ("attn.out", "fc2"):
                    plan[f"{i}.{name}"] = RowwiseParallel()
        return plan


def sequential_transformer(**kwargs: Any) -> SequentialTransformer:
    """Factory for specs: `gpuyard.train.examples:sequential_transformer` (pp, pp x dp, pp x tp)."""
    return SequentialTransformer(**kwargs)


def tiny_transformer(**kwargs: Any) -> TinyTransformer:
    """Factory for specs: `gpuyard.train.examples:tiny_transformer`."""
    return TinyTransformer(**kwargs)


class TensorBatchLoader:
    """Batches over tensors in a seeded per-epoch order, resumable through state_dict/load_state_dict.

    Shards by data-parallel rank (``dp_rank``/``dp_size``, which the trainer passes to factories that
    accept them), like the loader protocol of ``gpuyard.data``.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch = 0
        self.position = 0  # batches already yielded in this epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch."""
        self.epoch, self.position = epoch, 0

    def _order(self) -> torch.Tensor:
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return perm[self.dp_rank :: self.dp_size]

    def __len__(self) -> int:
        return len(self._order()) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order()
        while self.position < len(order) // self.batch_size:
            idx = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            yield self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and batches yielded."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def classification_loader(
    n: int = 512,
    in_features: int = 16,
    classes: int = 4,
    batch_size: int = 32,
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> TensorBatchLoader:
    """`classification_data` served by a TensorBatchLoader (a loader-protocol source)."""
    ds = classification_data(n, in_features, classes, seed)
    return TensorBatchLoader(ds.tensors[0], ds.tensors[1], batch_size, seed, dp_rank, dp_size)
