"""Optimization of a registered torch model: ONNX checked against onnxruntime, int8, torch.export, stored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuyard.errors import ConfigError
from gpuyard.models.fit import fit
from gpuyard.models.flavors import OnnxPredictor, check_model_file
from gpuyard.models.optimize import optimize_version
from gpuyard.models.registry import export, get_version, load, register_file, register_from_run
from gpuyard.models.spec import parse_spec

pytestmark = pytest.mark.integration


def test_optimize_stores_checked_onnx_and_measurements(home: Path, tmp_path: Path) -> None:
    spec = parse_spec({"name": "d", "dataset": "sklearn:digits", "params": {"epochs": 3, "hidden": 32}})
    result, _ = fit(spec)
    register_from_run("digits", result.run_id)
    report = optimize_version("digits:1", repeats=3)
    variants = {v["variant"]: v for v in report["variants"]}
    assert set(variants) == {"torch-fp32", "onnx-fp32", "onnx-int8", "torch-int8-dynamic", "torch-export"}
    assert variants["onnx-fp32"]["max_abs_diff_vs_torch"] < 1e-3
    assert variants["torch-export"]["max_abs_diff_vs_torch"] < 1e-5
    assert variants["onnx-int8"]["size_bytes"] < variants["onnx-fp32"]["size_bytes"]
    for v in variants.values():
        assert v["latency_ms_batch1"] > 0 and 0 <= v["accuracy"] <= 1
    # int8 changes the numbers a little, not the answers much
    assert abs(variants["onnx-int8"]["accuracy"] - variants["torch-fp32"]["accuracy"]) < 0.1
    mv = get_version("digits:1")
    assert {"model.onnx", "model.int8.onnx", "optimize.json"} <= set(mv.files)
    out = export("digits:1", tmp_path / "e")
    assert check_model_file(out / "model.onnx") == "onnx"
    assert json.loads((out / "optimize.json").read_text())["model"] == "digits:1"
    # The exported ONNX graph answers like the registered model
    from sklearn.datasets import load_digits

    X = load_digits().data.astype(np.float32)
    torch_pred = load("digits:1").predictor.predict(X)
    assert np.array_equal(OnnxPredictor(out / "model.onnx", "classification").predict(X), torch_pred)
    # ... and can be registered as an ONNX-flavored model of its own
    onnx_mv = register_file("digits-onnx", out / "model.onnx")
    assert onnx_mv.flavor == "onnx" and np.array_equal(load("digits-onnx").predictor.predict(X), torch_pred)


def test_optimize_refuses_sklearn_models(home: Path) -> None:
    spec = parse_spec(
        {
            "name": "t",
            "dataset": "sklearn:iris",
            "trainer": "gpuyard.models.builtin:train_sklearn",
            "params": {"estimator": "sklearn.tree.DecisionTreeClassifier"},
        }
    )
    result, _ = fit(spec)
    register_from_run("iris", result.run_id)
    with pytest.raises(ConfigError, match="applies to torch models"):
        optimize_version("iris:1")
