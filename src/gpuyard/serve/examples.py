"""Reference models for the server's tests, benchmark and docs: a tiny MLP, a small CNN, a small transformer.

They are factories (``gpuyard.serve.examples:tiny_mlp``) so the registry can store their weights as
safetensors and rebuild them in any replica process. The MLP is so small that HTTP handling dominates
its cost. The transformer as the benchmark registers it (4 tokens, d_model=384: one sample's matrix
products have 4 rows, so its forward pass is bound by reading the weights) takes about 3 ms alone on
one core of this machine and about 0.7 ms per sample in a batch of 32: batching decides its
throughput. With the defaults (16 tokens, d_model=128) it is 0.65 ms alone and 0.32 ms per sample in
a batch: fine for tests, too cheap to show batching.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def tiny_mlp(in_features: int = 16, hidden: int = 32, classes: int = 4) -> Any:
    """Linear -> ReLU -> Linear."""
    from torch import nn

    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def small_cnn(channels: int = 32, classes: int = 10, size: int = 28) -> Any:
    """Three 3x3 conv blocks (1 -> c -> 2c -> 2c), pooling, a linear head; input ``(1, size, size)``."""
    from torch import nn

    c = channels
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * c * (size // 4) ** 2, classes),
    )


def small_transformer(
    tokens: int = 16, features: int = 16, d_model: int = 128, layers: int = 4, classes: int = 10
) -> Any:
    """Linear embedding -> ``layers`` transformer encoder layers (4 heads) -> mean over tokens -> head.

    Input ``(tokens, features)``. Many small operators per layer: a single sample pays their dispatch
    cost and reads every weight for one row, which a batch shares.
    """
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(features, d_model)
            layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(x)).mean(dim=1))

    del tokens  # the architecture is independent of the sequence length; kept for the signature
    return Encoder()


def register_example(name: str, kind: str = "mlp", seed: int = 0, **kwargs: Any) -> Any:
    """Register ``tiny_mlp``, ``small_cnn`` or ``small_transformer`` (random weights) on N(0, 1) inputs.

    The signature is inferred from those inputs, and they become the model's drift reference.

    Returns:
        (the ModelVersion, the reference inputs ``X`` the signature was inferred from).
    """
    import torch

    from gpuyard.models.registry import register_model
    from gpuyard.models.signature import infer_signature

    torch.manual_seed(seed)
    factory = {"mlp": tiny_mlp, "cnn": small_cnn, "transformer": small_transformer}[kind]
    module = factory(**kwargs).eval()
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        X = rng.normal(size=(512, kwargs.get("in_features", 16))).astype(np.float32)
    elif kind == "transformer":
        X = rng.normal(size=(256, kwargs.get("tokens", 16), kwargs.get("features", 16))).astype(np.float32)
    else:
        size = kwargs.get("size", 28)
        X = rng.normal(size=(64, 1, size, size)).astype(np.float32)
    with torch.inference_mode():
        preds = module(torch.from_numpy(X)).argmax(1).numpy()
    signature = infer_signature(X, preds, "classification")
    mv = register_model(
        name,
        module,
        "classification",
        signature,
        factory=f"gpuyard.serve.examples:{factory.__name__}",
        factory_kwargs=kwargs,
    )
    from gpuyard.serve.alerts import reference_from_array
    from gpuyard.serve.model import load_served

    reference_from_array(load_served(mv.ref), X, source="example:N(0,1)")
    return mv, X
