"""Model signatures: the input and output schema a registered model promises (serving checks it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuyard.errors import ConfigError


def infer_signature(
    X: np.ndarray, y_pred: np.ndarray, task: str, feature_names: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """Describe inputs (dtype, shape with -1 for the batch, names, observed per-feature range) and outputs.

    Args:
        X: a sample of inputs (the training features).
        y_pred: the model's predictions on ``X`` (gives the output dtype and, for classes, the labels).
        task: classification or regression.
        feature_names: column names when known.
    """
    X = np.asarray(X)
    if X.ndim < 2 or len(X) == 0:
        raise ConfigError(f"a signature needs a non-empty batch of inputs, got shape {X.shape}")
    y_pred = np.asarray(y_pred)
    inputs: dict[str, Any] = {
        "dtype": "float32",
        "shape": [-1, *X.shape[1:]],
        "min": np.min(X, axis=0).reshape(-1).astype(float).tolist(),
        "max": np.max(X, axis=0).reshape(-1).astype(float).tolist(),
    }
    if feature_names:
        inputs["names"] = list(feature_names)
    outputs: dict[str, Any] = {"dtype": str(y_pred.dtype), "shape": [-1]}
    if task == "classification":
        outputs["classes"] = np.unique(y_pred).tolist()
    return {"task": task, "inputs": inputs, "outputs": outputs}


def check_input(signature: dict[str, Any], X: np.ndarray) -> None:
    """Check that ``X`` matches the signature's input shape (batch dimension free).

    Raises:
        ConfigError: wrong number of dimensions or a wrong feature size, naming both.
    """
    shape = signature.get("inputs", {}).get("shape")
    if not shape:
        return
    X = np.asarray(X)
    if X.ndim != len(shape) or any(want not in (-1, got) for want, got in zip(shape, X.shape, strict=True)):
        raise ConfigError(f"input shape {list(X.shape)} does not match the model's signature {shape}")
