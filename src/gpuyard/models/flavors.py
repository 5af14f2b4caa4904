"""Model flavors: how a model is saved, checked and loaded without pickle, and how it predicts.

- ``torch``: weights as safetensors plus a JSON config naming a factory ``module:function`` and its
  keyword arguments; loading calls the factory and loads the state dict (no code in the file).
- ``sklearn``: a scikit-learn estimator stored with skops; loading trusts only the exact types on
  gpuyard's allow-list (:mod:`gpuyard.models.safety`) and refuses anything else the file asks for.
- ``onnx``: an ONNX graph run with onnxruntime, its weights inside the file.

Any other file (pickle, ``torch.save`` archives, arbitrary bytes) is refused by :func:`check_model_file`;
every load goes through :func:`load_model`, which runs :func:`gpuyard.models.safety.check_model_safety`
first (a model file is data, never code).
"""

from __future__ import annotations

import json
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpuyard.errors import ConfigError, IntegrityError
from gpuyard.models.safety import UnsafeModelError, check_model_safety, check_onnx, check_skops
from gpuyard.refs import import_ref

FLAVORS = ("torch", "sklearn", "onnx")
FILE_FOR_FLAVOR = {"torch": "model.safetensors", "sklearn": "model.skops", "onnx": "model.onnx"}
CONFIG_FILE = "config.json"
FACTORY_ATTR = "_gpuyard_factory"


class Predictor(Protocol):
    """What evaluation, promotion and serving call: labels/values, and probabilities when there are any."""

    task: str

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Class labels (classification) or values (regression)."""

    def predict_proba(self, X: np.ndarray) -> np.ndarray | None:
        """Class probabilities ``(n, classes)``, or None when the model has none."""


class SklearnPredictor:
    """A fitted scikit-learn estimator."""

    def __init__(self, estimator: Any, task: str) -> None:
        self.model, self.task = estimator, task

    def predict(self, X: np.ndarray) -> np.ndarray:
        """The estimator's ``predict``."""
        return np.asarray(self.model.predict(X))

    def predict_proba(self, X: np.ndarray) -> np.ndarray | None:
        """The estimator's ``predict_proba`` when it has one."""
        if self.task != "classification" or not hasattr(self.model, "predict_proba"):
            return None
        return np.asarray(self.model.predict_proba(X))


class TorchPredictor:
    """A torch module mapping ``(n, features)`` to logits (classification) or ``(n,)``/``(n,1)`` values."""

    def __init__(self, module: Any, task: str) -> None:
        self.model, self.task = module, task

    def _forward(self, X: np.ndarray) -> np.ndarray:
        import torch

        self.model.eval()
        with torch.inference_mode():
            out = self.model(torch.as_tensor(np.asarray(X, dtype=np.float32)))
        return np.asarray(out.float().numpy())

    def predict(self, X: np.ndarray) -> np.ndarray:
        """argmax of the logits, or the regression output flattened."""
        out = self._forward(X)
        return out.argmax(axis=1) if self.task == "classification" else out.reshape(len(out))

    def predict_proba(self, X: np.ndarray) -> np.ndarray | None:
        """softmax of the logits."""
        if self.task != "classification":
            return None
        logits = self._forward(X)
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        return np.asarray(z / z.sum(axis=1, keepdims=True))


class OnnxPredictor:
    """An ONNX graph whose first output is logits (classification) or values (regression)."""

    def __init__(self, path: str | Path, task: str) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.task = task

    def _run(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.session.run(None, {self.input_name: np.asarray(X, dtype=np.float32)})[0])

    def predict(self, X: np.ndarray) -> np.ndarray:
        """argmax of the first output, or the output flattened."""
        out = self._run(X)
        return out.argmax(axis=1) if self.task == "classification" else out.reshape(len(out))

    def predict_proba(self, X: np.ndarray) -> np.ndarray | None:
        """softmax of the first output."""
        if self.task != "classification":
            return None
        logits = self._run(X)
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        return np.asarray(z / z.sum(axis=1, keepdims=True))


def flavor_of(model: Any) -> str:
    """``torch`` for an ``nn.Module``, ``sklearn`` for an estimator with ``fit``/``predict``.

    Raises:
        ConfigError: anything else.
    """
    torch = sys.modules.get("torch")  # a torch module can only exist once torch is imported
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    if hasattr(model, "fit") and hasattr(model, "predict") and hasattr(model, "get_params"):
        return "sklearn"
    raise ConfigError(
        f"cannot store a {type(model).__name__}: give a torch nn.Module or a scikit-learn estimator"
    )


def as_predictor(model: Any, task: str) -> Predictor:
    """Wrap a torch module or a scikit-learn estimator (a Predictor is returned as it is)."""
    if hasattr(model, "predict") and hasattr(model, "predict_proba") and hasattr(model, "task"):
        return model  # type: ignore[no-any-return]
    if flavor_of(model) == "torch":
        return TorchPredictor(model, task)
    return SklearnPredictor(model, task)


def save_model(
    model: Any,
    folder: str | Path,
    task: str,
    factory: str | None = None,
    factory_kwargs: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Write ``model`` into ``folder`` in its flavor's format; return (flavor, config).

    Args:
        model: a torch module or a scikit-learn estimator.
        folder: where to write ``model.safetensors``/``model.skops`` and ``config.json``.
        task: classification or regression.
        factory: for torch, ``module:function`` that rebuilds the architecture (default: the
            ``_gpuyard_factory`` attribute that gpuyard's factories set on the modules they build).
        factory_kwargs: keyword arguments of the factory.

    Raises:
        ConfigError: a torch module without a factory, or an unsupported model.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    flavor = flavor_of(model)
    config: dict[str, Any] = {"flavor": flavor, "task": task}
    if flavor == "torch":
        from safetensors.torch import save_file

        recorded = getattr(model, FACTORY_ATTR, None) or {}
        factory = factory or recorded.get("factory")
        factory_kwargs = factory_kwargs if factory_kwargs is not None else recorded.get("kwargs", {})
        if not factory:
            raise ConfigError(
                "a torch model needs a factory 'module:function' to be stored (weights are not code)"
            )
        import_ref(factory, "factory")  # fail now, not when someone loads it
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(folder / FILE_FOR_FLAVOR["torch"]))
        config |= {"factory": factory, "kwargs": factory_kwargs or {}}
    else:
        import sklearn
        import skops.io as sio

        sio.dump(model, folder / FILE_FOR_FLAVOR["sklearn"])
        config |= {
            "estimator": f"{type(model).__module__}.{type(model).__name__}",
            "sklearn": sklearn.__version__,
        }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return flavor, config


def load_model(folder: str | Path, config: dict[str, Any] | None = None) -> tuple[Any, Predictor]:
    """Load the model stored in ``folder``; return (raw model, predictor).

    Every load of a model file, in any command or server, comes here: the file is checked by
    :func:`gpuyard.models.safety.check_model_safety` before any of it is loaded.

    Raises:
        IntegrityError: a file that is not what its flavor says.
        UnsafeModelError: (a ConfigError) the file names a type, function or factory gpuyard does not
            load, or its header or external-data references are unsafe.
        ConfigError: an unknown flavor or an unimportable factory.
    """
    folder = Path(folder)
    if config is None:
        config = json.loads((folder / CONFIG_FILE).read_text())
    flavor, task = config.get("flavor"), str(config.get("task", "classification"))
    if flavor not in FLAVORS:
        raise ConfigError(f"model flavor {flavor!r} unknown: use one of {', '.join(FLAVORS)}")
    path = folder / FILE_FOR_FLAVOR[str(flavor)]
    found = check_model_file(path)
    if found != flavor:
        raise IntegrityError(f"{path} holds a {found} model, but its config says {flavor}")
    trusted = check_model_safety(path, str(flavor), config)
    if flavor == "torch":
        from safetensors.torch import load_file

        module = import_ref(str(config["factory"]), "factory")(**config.get("kwargs", {}))
        module.load_state_dict(load_file(str(path)))
        module.eval()
        return module, TorchPredictor(module, task)
    if flavor == "sklearn":
        estimator = _load_skops(path, trusted)
        return estimator, SklearnPredictor(estimator, task)
    predictor = OnnxPredictor(path, task)
    return predictor.session, predictor


def load_skops(path: str | Path) -> Any:
    """Load a skops file whose every node names a type on gpuyard's allow-list (checked first).

    skops then loads it trusting exactly those names, and audits the tree itself once more.

    Raises:
        UnsafeModelError: the file names any other type or function (it is refused, never loaded).
    """
    return _load_skops(path, check_skops(path))


def _load_skops(path: str | Path, trusted: list[str]) -> Any:
    """skops' own load, trusting exactly ``trusted`` (what :func:`check_skops` found and allowed)."""
    import skops.io as sio
    from skops.io.exceptions import UntrustedTypesFoundException

    try:
        return sio.load(path, trusted=trusted)
    except UntrustedTypesFoundException as exc:  # skops' own audit found more than ours: refuse too
        raise UnsafeModelError(f"{path}: refused by skops: {' '.join(str(exc).split())}") from exc


def check_model_file(path: str | Path) -> str:
    """A model file's format judged by content: ``torch`` (safetensors), ``sklearn`` (skops), ``onnx``.

    Raises:
        ConfigError: the file is pickle, a ``torch.save`` archive, or anything else; or it is missing.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model file {p} does not exist")
    # safetensors first: its 8-byte header length may well start with the byte pickle starts with.
    if _is_safetensors(p):
        return "torch"
    with p.open("rb") as fh:
        head = fh.read(2)
    if len(head) == 2 and head[0] == 0x80 and head[1] <= 5:  # PROTO opcode + protocol 2..5
        raise ConfigError(f"{p} is a pickle file; gpuyard never loads pickle: use safetensors, skops or ONNX")
    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as zf:
            names = zf.namelist()
        if "schema.json" in names:
            return "sklearn"
        if any(n.endswith("data.pkl") for n in names):
            raise ConfigError(f"{p} is a torch.save archive (pickle inside); store weights as safetensors")
    if _is_onnx(p):
        return "onnx"
    raise ConfigError(f"{p} is not a safetensors, skops or ONNX model file; other formats are refused")


def _is_safetensors(p: Path) -> bool:
    size = p.stat().st_size
    with p.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return False
        (n,) = struct.unpack("<Q", raw)
        if n < 2 or 8 + n > size or n > 100 << 20:
            return False
        header = fh.read(n)
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict)


def _is_onnx(p: Path) -> bool:
    import onnx

    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception:  # protobuf raises its own DecodeError: "no"
        return False
    if len(model.graph.node) > 0 and model.graph.input:
        check_onnx(p)  # a graph that keeps weights in external files is refused, naming the location
    try:
        onnx.checker.check_model(model)
    except Exception:  # the checker's ValidationError: "no"
        return False
    return len(model.graph.node) > 0
