"""A registered model version loaded for serving: one forward function from a batch to named outputs.

Loading goes through the registry (:func:`gpuyard.models.registry.load`, files checked against their
SHA-256 and by :mod:`gpuyard.models.safety`: a model file is data, never code). A torch module
runs its forward pass once per batch on the chosen device and the outputs (probabilities and labels)
are derived from those logits; scikit-learn and ONNX models go through the registry's predictors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError, GpuyardError
from gpuyard.serve.codec import InputSpec, input_spec

Outputs = dict[str, np.ndarray]


@dataclass
class ServedModel:
    """What the server needs from a model version.

    Attributes:
        name: registered model name (the URL path uses it).
        version: registered version number.
        task: classification or regression.
        signature: the registry's signature (inputs and outputs).
        spec: prepared input checks.
        forward: float32 batch -> {"predictions": (n,), "probabilities": (n, classes)?}.
        device: where the forward pass runs (``cpu``, ``cuda:0``).
        record: the registry record (``ModelVersion``), when loaded from the registry.
    """

    name: str
    version: int
    task: str
    signature: dict[str, Any]
    spec: InputSpec
    forward: Callable[[np.ndarray], Outputs]
    device: str = "cpu"
    record: Any = None


def resolve_device(device: str, replica: int = 0) -> str:
    """``auto`` -> ``cuda:<replica mod GPUs>`` when CUDA is present, else ``cpu``.

    Raises:
        ConfigError: ``cuda`` asked on a machine without CUDA, or an unknown device name.
    """
    import torch

    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device {device!r}: use auto, cpu or cuda")
    has_cuda = torch.cuda.is_available()
    if device == "cpu" or (device == "auto" and not has_cuda):
        return "cpu"
    if not has_cuda:
        raise ConfigError(f"--device {device}: CUDA is not available on this machine (use cpu or auto)")
    if device.startswith("cuda:"):
        return device
    return f"cuda:{replica % torch.cuda.device_count()}"


def torch_forward(
    module: Any, task: str, device: str, classes: list[Any] | None
) -> Callable[[np.ndarray], Outputs]:
    """One forward pass per batch; probabilities and labels both come from its logits."""
    import torch

    module = module.to(device).eval()
    labels = np.asarray(classes) if classes else None

    def forward(batch: np.ndarray) -> Outputs:
        with torch.inference_mode():
            out = module(torch.from_numpy(batch).to(device, non_blocking=True)).float()
            if task == "classification":
                proba = torch.softmax(out, dim=1).cpu().numpy()
                idx = proba.argmax(axis=1)
                preds = labels[idx] if labels is not None and len(labels) == proba.shape[1] else idx
                return {"predictions": preds, "probabilities": proba}
            return {"predictions": out.cpu().numpy().reshape(len(batch), -1).squeeze(1)}

    return forward


def predictor_forward(predictor: Any, task: str) -> Callable[[np.ndarray], Outputs]:
    """Forward through a registry predictor (scikit-learn, ONNX): labels, and probabilities if any."""

    def forward(batch: np.ndarray) -> Outputs:
        flat = batch.reshape(len(batch), -1) if batch.ndim > 2 else batch
        out = {"predictions": np.asarray(predictor.predict(flat))}
        if task == "classification":
            proba = predictor.predict_proba(flat)
            if proba is not None:
                out["probabilities"] = np.asarray(proba, dtype=np.float32)
        return out

    return forward


def load_served(ref: str, device: str = "cpu", max_rows: int = 1024) -> ServedModel:
    """Load ``ref`` (``NAME``, ``NAME:V``, ``NAME@ALIAS``) from the registry for serving.

    Raises:
        NotFoundError: unknown reference. ConfigError: a signature without an input shape.
        IntegrityError: a stored file changed since registration. UnsafeModelError (a ConfigError,
        exit 2): a file that names a type, function or factory gpuyard does not load.
    """
    from gpuyard.models.registry import load
    from gpuyard.models.signature import RECIPE_KEY, attach_recipe

    loaded = load(ref)
    mv = loaded.version
    signature = mv.signature
    if RECIPE_KEY not in signature and mv.dataset_version:
        # Registered before versions carried their recipe: take it from the training dataset now.
        with contextlib.suppress(GpuyardError):
            signature = attach_recipe(signature, mv.dataset_version)
    spec = input_spec(signature, max_rows=max_rows)
    classes = (signature.get("outputs") or {}).get("classes")
    if mv.flavor == "torch":
        forward = torch_forward(loaded.model, mv.task, device, classes)
    else:
        if device != "cpu":
            raise ConfigError(f"{mv.ref} is a {mv.flavor} model: it runs on cpu only (got --device {device})")
        forward = predictor_forward(loaded.predictor, mv.task)
    return ServedModel(mv.name, mv.version, mv.task, signature, spec, forward, device, mv)


def warm_up(model: ServedModel, sizes: tuple[int, ...] = (1, 8)) -> None:
    """Run the forward pass on zeros (inside the accepted range) so the first request pays no set-up."""
    zeros = np.clip(np.zeros(model.spec.n_features), model.spec.low, model.spec.high)
    sample = zeros.astype(np.float32).reshape(model.spec.shape or (1,))
    for n in sizes:
        model.forward(np.repeat(sample[None], n, axis=0))
