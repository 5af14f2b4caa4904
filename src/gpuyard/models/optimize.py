"""Optimization for deployment of a registered torch model: ONNX, int8 dynamic quantization, torch.export.

For one version this produces, side by side with the fp32 PyTorch baseline:

- ``model.onnx``: exported with ``torch.onnx.export`` and checked against onnxruntime (largest absolute
  difference of the outputs on holdout rows must stay under ``atol``, else nothing is stored);
- ``model.int8.onnx``: onnxruntime's dynamic int8 quantization of that graph (weights int8,
  activations quantized on the fly);
- torch's own dynamic int8 quantization (``quantize_dynamic`` on the Linear layers), measured only;
- ``torch.export``: the exported program is checked for equal outputs and timed; its ``.pt2`` archive
  is not stored, because the registry only keeps safetensors / skops / ONNX files.

Size, latency (median of repeated calls, batch 1 and batch 64) and the holdout metric before and after
are written to ``optimize.json``, stored with the version like the ONNX files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError, IntegrityError
from gpuyard.models.metrics import DEFAULT_METRICS, compute
from gpuyard.models.promote import holdout_for
from gpuyard.models.registry import ModelVersion, _resolve_row, get_version, load, record_event
from gpuyard.store import get_artifacts, get_store
from gpuyard.store.db import Store

ATOL = 1e-4
REPEATS = 50


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    # onnxruntime's quantizer logs an advisory WARNING on the root logger at every call.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def latency_ms(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Median wall time of ``fn()`` in milliseconds, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return float(statistics.median(times))


def _measure(
    name: str,
    forward: Callable[[np.ndarray], np.ndarray],
    X: np.ndarray,
    y: np.ndarray,
    task: str,
    metric: str,
    size: int | None,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    out = forward(X)
    pred = out.argmax(axis=1) if task == "classification" else out.reshape(len(out))
    x1, x64 = X[:1], X[: min(64, len(X))]
    return {
        "variant": name,
        "size_bytes": size,
        "latency_ms_batch1": latency_ms(lambda: forward(x1), repeats),
        "latency_ms_batch64": latency_ms(lambda: forward(x64), repeats),
        metric: compute(metric, y, pred),
    }


def optimize_version(
    ref: str,
    *,
    holdout: str | None = None,
    atol: float = ATOL,
    repeats: int = REPEATS,
    store: Store | None = None,
) -> dict[str, Any]:
    """Export, quantize and measure the torch model ``ref``; store the ONNX files and the report with it.

    Raises:
        ConfigError: not a torch model. IntegrityError: ONNX outputs differ from PyTorch beyond ``atol``.
    """
    import torch

    store = store or get_store()
    mv = get_version(ref, store)
    if mv.flavor != "torch":
        raise ConfigError(f"{mv.ref} is a {mv.flavor} model; optimization applies to torch models")
    module = load(mv.ref, store).model.eval()
    X, y, desc = holdout_for(mv, holdout)
    X = np.asarray(X, dtype=np.float32)
    metric = DEFAULT_METRICS[mv.task][0]

    def torch_forward(model: Any) -> Callable[[np.ndarray], np.ndarray]:
        def run(a: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return np.asarray(model(torch.from_numpy(a)).float().numpy())

        return run

    report: dict[str, Any] = {
        "model": mv.ref,
        "holdout": desc,
        "rows": len(X),
        "metric": metric,
        "torch_threads": torch.get_num_threads(),
        "variants": [],
    }
    base = _measure(
        "torch-fp32", torch_forward(module), X, y, mv.task, metric, mv.files["model.safetensors"]["size"]
    )
    report["variants"].append(base)
    with tempfile.TemporaryDirectory(prefix="gpuyard-optimize-") as tmp:
        onnx_path, int8_path = Path(tmp) / "model.onnx", Path(tmp) / "model.int8.onnx"
        report["variants"] += _onnx_variants(module, X, y, mv, metric, onnx_path, int8_path, atol, repeats)
        report["variants"].append(_torch_int8(module, X, y, mv, metric, torch_forward, repeats))
        report["variants"].append(_torch_export(module, X, y, mv, metric, atol, repeats))
        (Path(tmp) / "optimize.json").write_text(json.dumps(report, indent=2))
        _store(mv, [onnx_path, int8_path, Path(tmp) / "optimize.json"], report, store)
    return report


def _onnx_variants(
    module: Any,
    X: np.ndarray,
    y: np.ndarray,
    mv: ModelVersion,
    metric: str,
    onnx_path: Path,
    int8_path: Path,
    atol: float,
    repeats: int,
) -> list[dict[str, Any]]:
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    sample = torch.from_numpy(X[:8])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (sample,),
            str(onnx_path),
            dynamo=False,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )
    out = []
    for name, path in (("onnx-fp32", onnx_path), ("onnx-int8", int8_path)):
        if name == "onnx-int8":
            with warnings.catch_warnings(), _quiet_root_logger():
                warnings.simplefilter("ignore")
                quantize_dynamic(str(onnx_path), str(path), weight_type=QuantType.QInt8)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def forward(a: np.ndarray, s: Any = session) -> np.ndarray:
            return np.asarray(s.run(None, {"input": a})[0])

        row = _measure(name, forward, X, y, mv.task, metric, path.stat().st_size, repeats)
        with torch.inference_mode():
            ref = module(torch.from_numpy(X)).numpy()
        got = forward(X)
        row["max_abs_diff_vs_torch"] = float(np.abs(got - ref).max())
        if name == "onnx-fp32" and not np.allclose(got, ref, rtol=atol, atol=atol):
            raise IntegrityError(
                f"{mv.ref}: ONNX outputs differ from PyTorch by up to {row['max_abs_diff_vs_torch']:.2e} "
                f"(tolerance {atol:.0e}); nothing stored"
            )
        out.append(row)
    return out


def _torch_int8(
    module: Any,
    X: np.ndarray,
    y: np.ndarray,
    mv: ModelVersion,
    metric: str,
    torch_forward: Callable[[Any], Callable[[np.ndarray], np.ndarray]],
    repeats: int,
) -> dict[str, Any]:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of torchao, which is not a dependency here
        qmodel = torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
    size = 0
    for mod in qmodel.modules():
        # A quantized Linear: packed int8 weight (a method, not a tensor) + fp32 bias.
        if hasattr(mod, "weight") and callable(mod.weight):
            w = mod.weight()
            size += w.numel() * w.element_size() + (mod.bias().numel() * 4 if mod.bias() is not None else 0)
    size += sum(b.numel() * b.element_size() for b in qmodel.buffers())
    row = _measure("torch-int8-dynamic", torch_forward(qmodel), X, y, mv.task, metric, size, repeats)
    row["size_note"] = "int8 weights + fp32 biases and buffers, in memory (not stored)"
    return row


def _torch_export(
    module: Any, X: np.ndarray, y: np.ndarray, mv: ModelVersion, metric: str, atol: float, repeats: int
) -> dict[str, Any]:
    import torch

    sample = torch.from_numpy(X[:8])
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(module, (sample,), dynamic_shapes=({0: batch},))
    exported = program.module()

    def forward(a: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return np.asarray(exported(torch.from_numpy(a)).numpy())

    row = _measure("torch-export", forward, X, y, mv.task, metric, None, repeats)
    with torch.inference_mode():
        row["max_abs_diff_vs_torch"] = float(np.abs(forward(X) - module(torch.from_numpy(X)).numpy()).max())
    row["graph_nodes"] = len(program.graph.nodes)
    return row


def _store(mv: ModelVersion, paths: list[Path], report: dict[str, Any], store: Store) -> None:
    artifacts = get_artifacts()
    added = {}
    for path in paths:
        info = artifacts.put_blob(path)
        added[path.name] = {"key": info.key, "sha256": info.sha256, "size": info.size}
    with store.session() as s:
        row = _resolve_row(s, mv.ref)
        row.files = {**row.files, **added}
        summary = {
            v["variant"]: {k: v.get(k) for k in ("size_bytes", "latency_ms_batch1", report["metric"])}
            for v in report["variants"]
        }
        record_event(s, mv.name, mv.version, "optimized", summary)
