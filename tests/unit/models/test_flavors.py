"""Model files: safetensors + factory, skops with a trust list, ONNX; pickle and anything else refused."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer
from sklearn.tree import DecisionTreeClassifier

from gpuyard.errors import ConfigError, IntegrityError
from gpuyard.models.builtin import mlp
from gpuyard.models.flavors import check_model_file, load_model, load_skops, save_model

pytestmark = pytest.mark.unit


def _custom_transform(x: np.ndarray) -> np.ndarray:
    return x * 2


def test_torch_roundtrip_rebuilds_from_factory(tmp_path: Path) -> None:
    net = mlp(8, 3, hidden=16)
    torch.nn.init.normal_(net[1].weight)
    net[0].mean.fill_(0.5)  # buffers travel with the weights
    flavor, config = save_model(net, tmp_path, "classification")
    assert flavor == "torch" and config["factory"] == "gpuyard.models.builtin:mlp"
    assert check_model_file(tmp_path / "model.safetensors") == "torch"
    loaded, predictor = load_model(tmp_path)
    x = torch.randn(5, 8)
    assert torch.equal(loaded(x), net.eval()(x))
    assert predictor.predict_proba(x.numpy()).sum(axis=1) == pytest.approx(np.ones(5), abs=1e-5)


def test_torch_module_without_factory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a factory"):
        save_model(torch.nn.Linear(2, 2), tmp_path, "regression")


def test_sklearn_roundtrip_with_skops(tmp_path: Path) -> None:
    X, y = load_digits(return_X_y=True)
    tree = DecisionTreeClassifier(max_depth=4, random_state=0).fit(X, y)
    assert save_model(tree, tmp_path, "classification")[0] == "sklearn"
    assert check_model_file(tmp_path / "model.skops") == "sklearn"
    loaded, predictor = load_model(tmp_path)
    assert np.array_equal(loaded.predict(X), tree.predict(X))
    assert np.array_equal(predictor.predict(X), tree.predict(X))


def test_skops_file_asking_for_untrusted_code_is_refused(tmp_path: Path) -> None:
    import skops.io as sio

    pipe = make_pipeline(FunctionTransformer(_custom_transform), DecisionTreeClassifier())
    X, y = load_digits(return_X_y=True)
    pipe.fit(X[:100], y[:100])
    sio.dump(pipe, tmp_path / "p.skops")
    with pytest.raises(ConfigError, match="_custom_transform"):  # UnsafeModelError: exit 2 / HTTP 422
        load_skops(tmp_path / "p.skops")


def test_pickle_and_torch_save_and_junk_are_refused(tmp_path: Path) -> None:
    (tmp_path / "model.pkl").write_bytes(pickle.dumps({"w": [1, 2]}))
    with pytest.raises(ConfigError, match="pickle"):
        check_model_file(tmp_path / "model.pkl")
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    (tmp_path / "model.pt").write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match=r"torch\.save archive"):
        check_model_file(tmp_path / "model.pt")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ConfigError, match="not a safetensors, skops or ONNX"):
        check_model_file(tmp_path / "model.safetensors")
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(ConfigError, match="not a safetensors, skops or ONNX"):
        check_model_file(tmp_path / "x.zip")


def test_config_that_lies_about_the_flavor_is_refused(tmp_path: Path) -> None:
    X, y = load_digits(return_X_y=True)
    save_model(DecisionTreeClassifier(max_depth=2).fit(X, y), tmp_path, "classification")
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.skops").read_bytes())
    (tmp_path / "config.json").write_text('{"flavor": "torch", "task": "classification", "factory": "x:y"}')
    with pytest.raises((IntegrityError, ConfigError)):
        load_model(tmp_path)
